"""Token means over a microbatched batch: which microbatch losses are a mean over items, and what the strategy says
when it cannot know.

A loss averaged over the items of its microbatch (tokens whose label is not -100) weights the batch's rows unlike one
device's mean over the batch's items, unless each microbatch is weighted by its item count: the count the step
returns as ``num_items``, or the one the strategy counted while a transformers model computed its own loss
(:mod:`lightning_pipe.models.huggingface.loss_items`). For any other loss, :func:`uneven_ignored` finds the hint that
the step may be such a mean: an integer tensor of the batch holding the ignore value in different counts per
microbatch. Pure functions; no process group.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lightning_pipe.errors import PipelineUsageError

#: the label value the usual losses ignore (``torch.nn.CrossEntropyLoss``'s and transformers' ``ignore_index``)
IGNORE_INDEX = -100


def counted_items(name: str, counted: list[torch.Tensor | None]) -> list[torch.Tensor | None] | None:
    """The microbatches' counted items when every microbatch's loss was counted, ``None`` when none was; refuses a
    step whose loss was the model's own token mean in some microbatches of a batch only."""
    if all(c is None for c in counted):
        return None
    if any(c is None for c in counted):
        which = [m for m, c in enumerate(counted) if c is None]
        raise PipelineUsageError(
            f"`{name}` returned the model's own token-mean loss (`output.loss`) in some microbatches of a batch but"
            f" another value in microbatches {which}, so the strategy cannot weight them alike. Return `output.loss`"
            " unchanged in every step, or return `num_items` with the loss, e.g."
            " `{'loss': loss, 'num_items': (labels != -100).sum()}`."
        )
    return counted


def uneven_ignored(microbatches: list[Any], ignore_index: int = IGNORE_INDEX) -> tuple[str, list[int]] | None:
    """The first integer tensor of the batch (its path, e.g. ``batch['labels']``) that holds ``ignore_index`` in
    different counts per microbatch, with the counts; ``None`` when there is none."""
    if len(microbatches) < 2:
        return None
    for path, _ in _walk(microbatches[0], ()):
        counts = []
        for mb in microbatches:
            tensor = _at(mb, path)
            counts.append(int((tensor == ignore_index).sum()) if isinstance(tensor, torch.Tensor) else 0)
        if any(counts) and len(set(counts)) > 1:
            return _name(path), counts
    return None


def uneven_ignored_message(name: str, tensor: str, counts: list[int]) -> str:
    return (
        f"`{name}` returned a loss without `num_items`, and `{tensor}` holds the ignore value {IGNORE_INDEX} in"
        f" different counts per microbatch ({counts}). If the loss is a mean over the items that are not"
        f" {IGNORE_INDEX} (e.g. `cross_entropy(..., ignore_index=-100)`), the strategy's mean of the microbatch means"
        " is not one device's mean over the batch. Return `{'loss': loss, 'num_items': (labels != -100).sum()}`"
        " (the items the loss averages over; shifted labels for a causal LM) so each microbatch is weighted by its"
        " items. (Shown once.)"
    )


def _walk(obj: Any, path: tuple) -> Iterator[tuple[tuple, torch.Tensor]]:
    """``(path, tensor)`` of every integer tensor in ``obj``; a path is a tuple of keys and indices."""
    if isinstance(obj, torch.Tensor):
        if not (obj.is_floating_point() or obj.is_complex() or obj.dtype == torch.bool):
            yield path, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _walk(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _walk(value, (*path, index))


def _at(obj: Any, path: tuple) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def _name(path: tuple) -> str:
    return "batch" + "".join(f"[{key!r}]" for key in path)
