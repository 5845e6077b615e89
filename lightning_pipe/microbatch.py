"""Batches and microbatches: size, equal splitting along dim 0, and a signature that all pipeline ranks compare."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_pipe.errors import MicrobatchError


def _tensors(obj: Any) -> list[torch.Tensor]:
    # Lists and tuples tested before Mapping: an ABC isinstance check is several times slower (runs every step).
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors(v)]
    return []


def batch_size(batch: Any) -> int:
    """The leading dimension of the first tensor in ``batch``."""
    for t in _tensors(batch):
        if t.dim() > 0:
            return t.shape[0]
    raise MicrobatchError(
        f"Cannot split a batch of type {type(batch).__name__} into microbatches: it holds no tensor with a batch"
        " dimension. The DataLoader must yield tensors (or tuples/lists/dicts of them) batched along dim 0."
    )


def split_batch(batch: Any, n: int, sizes: Sequence[int] | None = None) -> list[Any]:
    """Split every tensor whose dim 0 is the batch size into ``n`` chunks; everything else is shared.

    Chunks are equal unless ``sizes`` gives their sizes (summing to the batch size): evaluation's forward-only pass
    needs no equal shapes, so a batch that does not divide evenly still splits.
    """
    size = batch_size(batch)
    if sizes is None:
        if size % n != 0:
            raise MicrobatchError(f"A batch of {size} samples does not split into {n} equal microbatches.")
        sizes = [size // n] * n
    elif len(sizes) != n or sum(sizes) != size:
        raise MicrobatchError(f"Microbatch sizes {list(sizes)} do not split a batch of {size} samples into {n}.")
    sizes = list(sizes)

    def split(obj: Any) -> list[Any]:
        if isinstance(obj, torch.Tensor):
            if obj.dim() > 0 and obj.shape[0] == size:
                return list(obj.split(sizes))
            return [obj] * n
        if isinstance(obj, (list, tuple)):
            parts = [split(v) for v in obj]
            if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
                return [type(obj)(*(p[i] for p in parts)) for i in range(n)]
            return [type(obj)(p[i] for p in parts) for i in range(n)]
        if isinstance(obj, Mapping):
            parts = {k: split(v) for k, v in obj.items()}
            return [
                type(obj)({k: parts[k][i] for k in obj}) if type(obj) is not dict else {k: parts[k][i] for k in obj}
                for i in range(n)
            ]
        return [obj] * n

    return split(batch)


def signature(obj: Any) -> tuple:
    """Shapes and dtypes of every tensor in ``obj``: equal signatures mean torch can reuse inferred stage shapes."""
    return tuple((tuple(t.shape), str(t.dtype)) for t in _tensors(obj))
