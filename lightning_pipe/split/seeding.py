"""The random streams a split network's initial values are drawn from.

``init_values="per_unit"``: the seed of each module or unit, ``seed + crc32(name)``, so its initial values depend on
its name in the full model only, not on the pipeline layout or on which rank holds it; the model's own init hooks
(:mod:`lightning_pipe.split.initialization`) always draw under these seeds. ``init_values="one_device"``: the global
streams as they were when ``configure_model`` began (:class:`Streams`), replayed in one device's order
(:mod:`lightning_pipe.split.deferred_init`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Streams:
    """The global random streams at one moment: the CPU generator's state and, for a CUDA ``device``, that device's."""

    cpu: torch.Tensor
    device: torch.device | None = None
    accelerator: torch.Tensor | None = None

    @classmethod
    def capture(cls, device: torch.device | None = None) -> Streams:
        if device is not None and device.type == "cuda":
            return cls(torch.get_rng_state(), device, torch.cuda.get_rng_state(device))
        return cls(torch.get_rng_state())

    def restore(self) -> None:
        """Set the streams back to this state: what is drawn next is what was drawn next then."""
        torch.set_rng_state(self.cpu)
        if self.accelerator is not None:
            torch.cuda.set_rng_state(self.accelerator, self.device)
