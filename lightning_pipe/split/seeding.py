"""The seed of each module or unit of a network: ``seed + crc32(name)``, so its initial values depend on its name in
the full model only, not on the pipeline layout or on which rank holds it.

Both ways of initialising a split network draw under these seeds: the model's own init hooks
(:mod:`lightning_pipe.split.initialization`) and the replay of what ``configure_model`` did on the meta device
(:mod:`lightning_pipe.split.deferred_init`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch


def unit_seed(seed: int, name: str) -> int:
    """The seed of the module or unit called ``name``."""
    return (seed + zlib.crc32(name.encode())) % (2**63)


def seeded(seed: int, name: str, fn: Callable[[], Any]) -> None:
    """Run ``fn`` with torch's random stream seeded by :func:`unit_seed`, restoring the stream afterwards."""
    # The accelerator's generator is restored too: initialisation must not shift the random stream of training.
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(unit_seed(seed, name))
        fn()
