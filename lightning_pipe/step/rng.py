"""The random streams of a pipelined run: the data stream every rank of a pipeline shares, and the compute stream.

See :class:`RngStreams`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_pipe.comm import collectives


class RngStreams:
    """Keeps the global CPU random stream identical on every rank of a pipeline, and equal to one device's.

    The stream decides the order of a shuffling DataLoader (its sampler draws a seed from it at each epoch), so every
    stage must draw the same numbers. Stages consume different numbers (dropout in different blocks, the user's step on
    the last stage only), so what runs inside a step draws from a second, *compute* stream; the global stream between
    steps is touched only by what every rank runs alike (the DataLoader, Lightning, the user's other hooks), as on one
    device with a model that draws no random numbers.
    """

    def __init__(self) -> None:
        self._compute: torch.Tensor | None = None

    def agree(self, group: Any, src: int) -> None:
        """Give every rank of ``group`` the global CPU stream of global rank ``src`` (collective)."""
        state = torch.get_rng_state()
        collectives.broadcast_(state, src, group)
        torch.set_rng_state(state)

    @contextmanager
    def compute(self) -> Iterator[None]:
        data = torch.get_rng_state()
        torch.set_rng_state(self._compute if self._compute is not None else data)
        try:
            yield
        finally:
            self._compute = torch.get_rng_state()
            torch.set_rng_state(data)
