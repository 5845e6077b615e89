"""Settling a microbatched step: the logs and outputs one full-batch call of the user's step would have produced.

Pure functions over recorded values; no process group.

- **Logs**: values logged per microbatch are combined with the call's ``reduce_fx``. ``mean`` (the default) is
  weighted: by the step's ``num_items`` when it returns one (a token-mean loss), else by ``batch_size=`` passed to
  ``self.log``, else by the microbatch sizes. A logged forward output of a torchmetrics object is replaced by the
  metric's full-batch value (:mod:`lightning_pipe.step.metrics`). A logged metric object is kept as it is.
  Values are combined in float64 on the device that holds them, weights entering as Python numbers, so merging reads
  nothing back to the host and copies nothing to the device: the step never waits for the device here. A device
  without float64 (Apple's MPS) merges on the CPU in float64 instead, one copy to the host per logged value.
- **Outputs**: tensors with a batch dimension are concatenated, scalar floats averaged with the same weights, integer
  scalars (counts) summed; dicts, lists and tuples entry by entry.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch

from lightning_pipe.compat.torchmetrics import is_metric_container
from lightning_pipe.errors import PipelineUsageError
from lightning_pipe.step.interception import LoggedValue
from lightning_pipe.structures import is_namedtuple, map_structure

#: ``(True, value)`` when a logged value is a metric's forward output whose full-batch value is known.
StepValueOf = Callable[[Any], tuple[bool, Any]]


def _scalar(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise PipelineUsageError(
                f"`self.log({name!r}, ...)` got a tensor of shape {tuple(value.shape)}; log scalars."
            )
        return value.detach().reshape(())
    return torch.tensor(float(value), dtype=torch.float64)


def merge_microbatch_logs(
    per_microbatch: Sequence[Sequence[LoggedValue]],
    weights: Sequence[float] | None = None,
    step_value_of: StepValueOf | None = None,
    weights_of: Mapping[str, Sequence[float]] | None = None,
) -> list[LoggedValue]:
    """Merge the logs of one batch's microbatches into what one full-batch call would have logged.

    ``weights`` are the microbatches' weights for mean-reduced values (equal when ``None``), ``weights_of`` those of
    particular names (a model's own token-mean loss: its items); ``step_value_of`` finds the full-batch value of a
    logged metric forward output.
    """
    order: list[str] = []
    grouped: dict[str, list[tuple[int, LoggedValue]]] = {}
    for index, logs in enumerate(per_microbatch):
        for entry in logs:
            if entry.name not in grouped:
                order.append(entry.name)
                grouped[entry.name] = []
            grouped[entry.name].append((index, entry))
    own = weights_of or {}
    return [_merge_one(name, grouped[name], own.get(name, weights), step_value_of) for name in order]


def _merge_one(
    name: str,
    entries: list[tuple[int, LoggedValue]],
    weights: Sequence[float] | None,
    step_value_of: StepValueOf | None,
) -> LoggedValue:
    first = entries[0][1]
    kwargs = dict(first.kwargs)
    if is_metric_container(first.value):
        return LoggedValue(name, first.value, kwargs)
    if step_value_of is not None:
        found = [step_value_of(e.value) for _, e in entries]
        if all(ok for ok, _ in found) and all(v is found[0][1] for _, v in found):
            return LoggedValue(name, _scalar(name, found[0][1]), kwargs)
    if len(entries) == 1:
        return LoggedValue(name, _scalar(name, first.value), kwargs)
    scalars = [_scalar(name, e.value) for _, e in entries]
    device = merge_device(scalars)
    if kwargs.get("batch_size") is not None:
        entry_weights = [float(e.kwargs["batch_size"]) for _, e in entries]
        kwargs["batch_size"] = int(sum(entry_weights))
    else:
        entry_weights = [1.0 if weights is None else float(weights[i]) for i, _ in entries]
    values = [converted(v, device, torch.float64) for v in scalars]
    merged = _reduce(values, kwargs.get("reduce_fx", "mean"), entry_weights)
    dtype = first.value.dtype if isinstance(first.value, torch.Tensor) else torch.float32
    return LoggedValue(name, merged.to(dtype), kwargs)


def merge_device(values: Sequence[torch.Tensor]) -> torch.device:
    """Where logged ``values`` are combined in float64: the device of the first one not on the CPU (a logged Python
    number is a CPU tensor; the user's losses are on the device), the CPU when none is or when the device has no
    float64 (MPS)."""
    device = next((v.device for v in values if v.device.type != "cpu"), torch.device("cpu"))
    return torch.device("cpu") if device.type == "mps" else device


def converted(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype`` on ``device``, naming the device only for a move (so that a move to the host is always
    written as one, and the step's host-read counter in the tests sees every move)."""
    return tensor.to(dtype) if tensor.device == device else tensor.to(device, dtype)


def _reduce(values: Sequence[torch.Tensor], reduce_fx: Any, weights: Sequence[float]) -> torch.Tensor:
    """``values`` (0-dim float64 tensors on one device) combined by ``reduce_fx``; a mean weighted by ``weights``,
    which enter as Python numbers (no copy to the device)."""
    name = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "mean")
    name = name.lower()
    if name == "sum":
        return torch.stack(list(values)).sum()
    if name in ("max", "amax"):
        return torch.stack(list(values)).max()
    if name in ("min", "amin"):
        return torch.stack(list(values)).min()
    return weighted_mean(values, weights)


def weighted_mean(values: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """The mean of the 0-dim float64 tensors ``values`` weighted by the Python numbers ``weights``, on their device:
    each value times its weight, summed, over the weights' sum (exact for integer weights, as sizes and counts are)."""
    return torch.stack([v * w for v, w in zip(values, weights)]).sum() / math.fsum(weights)


# ---------------------------------------------------------------------------------------------------- outputs
def merge_outputs(outputs: Sequence[Any], sizes: Sequence[float], hook: str) -> Any:
    """Combine one batch's per-microbatch step outputs into the output of one full-batch call.

    Tensors with a batch dimension are concatenated along dim 0; 0-dim floating tensors and floats (a mean loss) take
    the ``sizes``-weighted mean, 0-dim integer tensors (counts) the sum; dicts, lists and tuples are merged entry by
    entry; other values must be equal in every microbatch.
    """
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]
    if isinstance(first, torch.Tensor) and all(isinstance(o, torch.Tensor) for o in outputs):
        return _merge_tensors(outputs, sizes)
    if isinstance(first, Mapping) and all(isinstance(o, Mapping) and o.keys() == first.keys() for o in outputs):
        merged = {k: merge_outputs([o[k] for o in outputs], sizes, hook) for k in first}
        return merged if type(first) is dict else type(first)(merged)
    if isinstance(first, (list, tuple)) and all(type(o) is type(first) and len(o) == len(first) for o in outputs):
        columns = [merge_outputs([o[i] for o in outputs], sizes, hook) for i in range(len(first))]
        return type(first)(*columns) if is_namedtuple(first) else type(first)(columns)
    if isinstance(first, float) and all(isinstance(o, numbers.Real) for o in outputs):
        return math.fsum(float(o) * s for o, s in zip(outputs, sizes)) / math.fsum(sizes)
    if all(_same(o, first) for o in outputs):
        return first
    raise PipelineUsageError(
        f"`{hook}` returned values ({_describe(outputs)}) that cannot be combined across the microbatches of one"
        " batch. Return tensors with a batch dimension (concatenated), scalar tensors (averaged), or dicts/lists/tuples"
        " of them, or pass `eval_microbatches=1` to the strategy so each batch runs as one microbatch."
    )


def _merge_tensors(tensors: Sequence[torch.Tensor], sizes: Sequence[float]) -> torch.Tensor:
    first = tensors[0]
    if first.dim() > 0 and all(t.dim() == first.dim() and t.shape[1:] == first.shape[1:] for t in tensors):
        return torch.cat(list(tensors))
    if all(t.dim() == 0 for t in tensors):
        if first.is_floating_point():
            device = merge_device(tensors)
            mean = weighted_mean([converted(t, device, torch.float64) for t in tensors], [float(s) for s in sizes])
            return converted(mean, first.device, first.dtype)
        return torch.stack(list(tensors)).sum()
    raise PipelineUsageError(
        f"Step outputs of shapes {[tuple(t.shape) for t in tensors]} cannot be combined across microbatches: tensors"
        " need the same number of dimensions and equal sizes beyond dim 0. Pass `eval_microbatches=1` to the strategy"
        " so each batch runs as one microbatch."
    )


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values whose == raises or is ambiguous are not "the same"
        return False


def _describe(outputs: Sequence[Any]) -> str:
    return ", ".join(sorted({type(o).__name__ for o in outputs}))


def is_scalar_structure(obj: Any) -> bool:
    """Whether ``obj`` holds only scalars (numbers, strings, None, one-element tensors): cheap to share."""
    ok = [True]

    def check(leaf: Any) -> None:
        if isinstance(leaf, torch.Tensor):
            ok[0] = ok[0] and leaf.numel() <= 1
        elif not (leaf is None or isinstance(leaf, (numbers.Number, str))):
            ok[0] = False

    map_structure(obj, check)
    return ok[0]
