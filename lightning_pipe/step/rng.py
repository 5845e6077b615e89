"""The random streams of a pipelined run: the data stream every rank of a pipeline shares, and the compute stream.

See :class:`RngStreams`; :meth:`RngStreams.state_dict` is what a checkpoint's resume point keeps of them.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np
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
        #: the data stream's state kept aside while the compute stream runs (one per block entered)
        self._kept: list[torch.Tensor] = []

    def agree(self, group: Any, src: int) -> None:
        """Give every rank of ``group`` the global CPU stream of global rank ``src`` (collective)."""
        state = torch.get_rng_state()
        collectives.broadcast_(state, src, group)
        torch.set_rng_state(state)

    def agree_device(self, group: Any, src: int, device: torch.device) -> None:
        """Give every rank of ``group`` the CUDA generator state of global rank ``src`` for its own ``device``
        (collective; nothing on other devices): sampling on the device draws from it."""
        if device.type != "cuda":
            return
        state = torch.cuda.get_rng_state(device)
        collectives.broadcast_(state, src, group)
        torch.cuda.set_rng_state(state, device)

    def compute(self) -> RngStreams:
        """Within the block, torch's CPU generator is the compute stream (the data stream is kept aside and put back
        after). The block is this object (entered at every step: no generator-based context of its own)."""
        return self

    def __enter__(self) -> None:
        data = torch.get_rng_state()
        torch.set_rng_state(self._compute if self._compute is not None else data)
        self._kept.append(data)

    def __exit__(self, *exc: Any) -> None:
        self._compute = torch.get_rng_state()
        torch.set_rng_state(self._kept.pop())

    def state_dict(self, device: Optional[torch.device] = None) -> dict[str, Any]:
        """Every random stream of this process: the data stream (torch's global CPU generator), the compute stream,
        Python's and NumPy's global generators, and ``device``'s generator when it is a CUDA device. Tensors and
        plain values only, so a checkpoint holding it loads with ``weights_only=True``."""
        name, keys, position, has_gauss, gauss = np.random.get_state()
        state: dict[str, Any] = {
            "data": torch.get_rng_state(),
            "compute": None if self._compute is None else self._compute.clone(),
            "python": random.getstate(),
            "numpy": (name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), position, has_gauss, gauss),
        }
        if device is not None and device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(device)
        return state

    def load_state_dict(self, state: dict[str, Any], device: Optional[torch.device] = None) -> None:
        """Set every stream :meth:`state_dict` returned (a CUDA state only on a CUDA ``device``)."""
        torch.set_rng_state(state["data"])
        self._compute = None if state["compute"] is None else state["compute"].clone()
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
        name, keys, position, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
        if device is not None and device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], device)
