"""Batches and microbatches: size, the number and sizes of microbatches, splitting along dim 0, and a signature that
all pipeline ranks compare. Pure: no process group."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import torch

from lightning_pipe.errors import MicrobatchError
from lightning_pipe.structures import is_namedtuple, tensors_in


def batch_size(batch: Any) -> int:
    """The leading dimension of the first tensor in ``batch``."""
    for t in tensors_in(batch):
        if t.dim() > 0:
            return t.shape[0]
    raise MicrobatchError(
        f"Cannot split a batch of type {type(batch).__name__} into microbatches: it holds no tensor with a batch"
        " dimension. The DataLoader must yield tensors (or tuples/lists/dicts of them) batched along dim 0."
    )


def resolve_microbatches(
    microbatches: Union[int, str], microbatch_size: Union[int, None], batch_size: int, num_stages: int, setting: str
) -> int:
    """The number of microbatches for one batch; ``"auto"`` is the number of stages (the fewest that fill the pipe).

    ``setting`` names the argument in error messages (``microbatches`` or ``eval_microbatches``).
    """
    if microbatch_size is not None:
        if batch_size % microbatch_size != 0:
            raise MicrobatchError(
                f"A batch of {batch_size} samples does not split into microbatches of `microbatch_size="
                f"{microbatch_size}`. Use a batch size that is a multiple of it (or `drop_last=True` in the"
                " DataLoader for a short last batch)."
            )
        return batch_size // microbatch_size
    n = num_stages if microbatches == "auto" else int(microbatches)
    if n > batch_size and microbatches == "auto":
        # A short final batch with "auto": as many single-sample microbatches as there are samples.
        n = batch_size
    if batch_size % n != 0:
        raise MicrobatchError(
            f"A batch of {batch_size} samples does not split into `{setting}={n}` equal microbatches"
            f"{' (auto: one per stage)' if microbatches == 'auto' else ''}. torch's pipeline needs equal microbatch"
            f" shapes. Use a batch size that is a multiple of {n}, set `{setting}` to a divisor of {batch_size},"
            " or pass `drop_last=True` to the DataLoader if only the last batch is short."
        )
    return n


def training_microbatches(
    size: int,
    microbatches: Union[int, str],
    microbatch_size: Union[int, None],
    num_stages: int,
    accepts: Callable[[int], bool],
    schedule: str,
) -> int:
    """The number of equal microbatches a training batch of ``size`` samples runs as.

    The configured count where it divides the batch. Otherwise (a short last batch, a batch size the count does not
    divide) the fewest equal microbatches, no larger than the configured ones, that torch's schedule accepts
    (``accepts(count)``), else the most below that: a 9-sample batch under ``microbatches=2`` runs as 3 of 3. Equal
    microbatches keep the step exact (each microbatch's loss weighs 1/count, its share of the batch). A batch that no
    count can run raises :class:`MicrobatchError`.
    """
    if microbatch_size is not None:
        if size % microbatch_size == 0:
            return size // microbatch_size
        target, configured = -(-size // microbatch_size), f"microbatches of `microbatch_size={microbatch_size}`"
    else:
        n = num_stages if microbatches == "auto" else int(microbatches)
        n = min(n, size) if microbatches == "auto" else n
        if size % n == 0:
            return n
        target, configured = n, f"`microbatches={n}` equal microbatches"
    divisors = [d for d in range(1, size + 1) if size % d == 0]
    for d in [d for d in divisors if d >= target] + [d for d in reversed(divisors) if d < target]:
        if accepts(d):
            return d
    raise MicrobatchError(
        f"A batch of {size} samples does not split into {configured}, and torch's {schedule} schedule with"
        f" {num_stages} stages accepts no count of equal microbatches that divides it"
        f" ({', '.join(map(str, divisors))}). Use `schedule='GPipe'` (it runs any count), another batch size, or"
        " `drop_last=True` in the DataLoader if only the last batch is short."
    )


def split_batch(batch: Any, n: int, sizes: Sequence[int] | None = None, *, size: int | None = None) -> list[Any]:
    """Split every tensor whose dim 0 is the batch size into ``n`` chunks; everything else is shared.

    Chunks are equal unless ``sizes`` gives their sizes (summing to the batch size): evaluation's forward-only pass
    needs no equal shapes, so a batch that does not divide evenly still splits. ``size``: the batch size, when the
    caller measured it already (:func:`batch_size`).
    """
    size = batch_size(batch) if size is None else size
    if sizes is None:
        if size % n != 0:
            raise MicrobatchError(f"A batch of {size} samples does not split into {n} equal microbatches.")
        sizes = [size // n] * n
    elif len(sizes) != n or sum(sizes) != size:
        raise MicrobatchError(f"Microbatch sizes {list(sizes)} do not split a batch of {size} samples into {n}.")
    return _split(batch, size, list(sizes))


def _split(obj: Any, size: int, sizes: list[int]) -> list[Any]:
    # A module-level function, not a closure: a recursive closure is a reference cycle, left to the garbage collector
    # (one a step).
    n = len(sizes)
    if isinstance(obj, torch.Tensor):
        if obj.dim() > 0 and obj.shape[0] == size:
            return list(obj.split_with_sizes(sizes))  # (`split` is a Python wrapper around it: twice the CPU)
        return [obj] * n
    if isinstance(obj, (list, tuple)):
        parts = [_split(v, size, sizes) for v in obj]
        if type(obj) is tuple:  # the usual batch, `(inputs, targets)`
            return list(zip(*parts)) if parts else [()] * n
        if type(obj) is list:  # a DataLoader's batch of `(inputs, targets)` samples
            return [[p[i] for p in parts] for i in range(n)]
        if is_namedtuple(obj):
            return [type(obj)(*(p[i] for p in parts)) for i in range(n)]
        return [type(obj)(p[i] for p in parts) for i in range(n)]
    if isinstance(obj, Mapping):
        split = {k: _split(v, size, sizes) for k, v in obj.items()}
        return [
            type(obj)({k: split[k][i] for k in obj}) if type(obj) is not dict else {k: split[k][i] for k in obj}
            for i in range(n)
        ]
    return [obj] * n


def signature(obj: Any) -> tuple:
    """Shapes and dtypes of every tensor in ``obj``: equal signatures mean torch can reuse inferred stage shapes."""
    return tuple([(t.shape, t.dtype) for t in tensors_in(obj)])


def epoch_batch_sizes(loader: Any) -> list[tuple[str, int]] | None:
    """The batch sizes a plain ``DataLoader`` yields in an epoch, each with a description for messages: its full
    batches and, unless ``drop_last``, the short last one. ``None`` where they cannot be known without iterating (an
    iterable dataset, a custom batch sampler, a combination of loaders)."""
    from torch.utils.data import DataLoader

    if not isinstance(loader, DataLoader) or loader.batch_size is None:
        return None
    try:
        samples = len(loader.sampler)  # a DistributedSampler: this replica's share
    except TypeError:
        return None
    full, rest = divmod(samples, loader.batch_size)
    sizes = [(f"batches ({samples} samples per epoch in batches of {loader.batch_size})", loader.batch_size)] * bool(
        full
    )
    if rest and not loader.drop_last:
        sizes.append((f"last batch of each epoch ({samples} samples in batches of {loader.batch_size})", rest))
    return sizes
