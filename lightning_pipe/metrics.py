"""torchmetrics objects under a pipeline: the last stage updates them; every other rank mirrors their state.

The user's step runs (per microbatch) only on the last-stage rank, so only there do metrics see data. After each
step the last stage sends what changed (:func:`collect_updates`) with its logs; the other ranks apply it
(:func:`apply_updates`). Logged metric objects travel as :class:`MetricRef` (their attribute path) and are resolved
to each rank's own object, so ``self.log("acc", self.acc)`` gives every rank the same step and epoch values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe import transport
from lightning_pipe.errors import PipelineUsageError
from lightning_pipe.interception import LoggedValue, _is_metric

_CPU = torch.device("cpu")


def to_device(obj: Any, device: torch.device) -> Any:
    return transport.map_structure(obj, lambda t: t.to(device) if isinstance(t, torch.Tensor) else t)


@dataclass(frozen=True)
class MetricRef:
    """A torchmetrics object named by its attribute path in the LightningModule (the same on every rank)."""

    name: str | None


@dataclass
class MetricUpdate:
    """How one metric's state changed during a step on the last-stage rank, in a form other ranks can apply.

    Tensor states are sent whole; list states (``dist_reduce_fx="cat"``) only from ``list_start[state]`` on, the
    length every rank's list had before the step.
    """

    name: str
    update_count: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    lists: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    list_start: dict[str, int] = field(default_factory=dict)
    forward_cache: Any = None


def find_metrics(module: nn.Module) -> dict[str, nn.Module]:
    """Every torchmetrics object inside ``module``, by attribute path."""
    return {name: sub for name, sub in module.named_modules() if name and _is_metric(sub)}


def bind_metrics(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Make metrics without a process group of their own synchronise over ``group`` (the data-parallel replicas).

    torchmetrics synchronises over all processes by default. Every stage of a pipeline holds the same metric state, so
    a world-wide sync would count each sample once per stage (and hang when only some ranks compute).
    """
    for metric in find_metrics(module).values():
        if getattr(metric, "process_group", None) is None:
            metric.process_group = group


@dataclass(frozen=True)
class Snapshot:
    """One metric's state before a step: update count, list-state lengths, and copies of its tensor states."""

    update_count: int
    lengths: dict[str, int]
    tensors: dict[str, torch.Tensor]


def snapshot(metrics: Mapping[str, nn.Module]) -> dict[str, Snapshot]:
    """The state of each metric, taken before a step."""
    return {
        name: Snapshot(
            m._update_count,
            {k: len(v) for k, v in _states(m).items() if isinstance(v, list)},
            {k: v.detach().clone() for k, v in _states(m).items() if isinstance(v, torch.Tensor)},
        )
        for name, m in metrics.items()
    }


def _states(metric: nn.Module) -> dict[str, Any]:
    return {k: getattr(metric, k) for k in metric._defaults}


def settle_step_values(metrics: Mapping[str, nn.Module], before: Mapping[str, Snapshot]) -> None:
    """Give each metric called on several microbatches of one step the forward value of the whole batch.

    ``metric(preds, target)`` per microbatch leaves the last microbatch's value as the step value Lightning logs. When
    every state of the metric is summed or concatenated (Accuracy, Perplexity, MeanSquaredError, ...), the step's
    own state is the difference from ``before``; computing on it gives what one call on the full batch would have.
    Metrics with other reductions (max, min, custom) keep the last microbatch's value.
    """
    from torchmetrics.utilities.data import dim_zero_cat, dim_zero_sum

    for name, metric in metrics.items():
        prior = before[name]
        calls = metric._update_count - prior.update_count
        if calls <= 1 or metric._forward_cache is None or getattr(metric, "dist_sync_on_step", False):
            continue
        if not all(metric._reductions.get(k) in (dim_zero_sum, dim_zero_cat) for k in metric._defaults):
            continue
        # Compute on the step's own state in place (a copy could not deep-copy tensors with autograd history), then
        # put everything back; only this rank computes, so no synchronisation.
        saved = _states(metric)
        saved_count, saved_sync = metric._update_count, metric._to_sync
        try:
            for key, value in saved.items():
                step = value[prior.lengths.get(key, 0) :] if isinstance(value, list) else value - prior.tensors[key]
                setattr(metric, key, step)
            metric._update_count, metric._to_sync, metric._computed = calls, False, None
            value = metric.compute()
        finally:
            for key, state in saved.items():
                setattr(metric, key, state)
            metric._update_count, metric._to_sync, metric._computed = saved_count, saved_sync, None
        metric._forward_cache = value.detach() if isinstance(value, torch.Tensor) else value


def collect_updates(metrics: Mapping[str, nn.Module], before: Mapping[str, Snapshot]) -> list:
    """The state changes of the metrics updated (or reset) since ``before``, on CPU for pickling."""
    updates = []
    for name, metric in metrics.items():
        count, lengths = before[name].update_count, before[name].lengths
        if metric._update_count == count:
            continue
        update = MetricUpdate(name, metric._update_count, forward_cache=to_device(metric._forward_cache, _CPU))
        for key, value in _states(metric).items():
            if isinstance(value, list):
                start = lengths.get(key, 0) if len(value) >= lengths.get(key, 0) else 0
                update.lists[key] = [t.detach().cpu() for t in value[start:]]
                update.list_start[key] = start
            else:
                update.tensors[key] = value.detach().cpu()
        updates.append(update)
    return updates


def apply_updates(metrics: Mapping[str, nn.Module], updates: Sequence[MetricUpdate], device: torch.device) -> None:
    """Bring this rank's metrics to the last-stage rank's state."""
    for update in updates:
        metric = metrics[update.name]
        for key, value in update.tensors.items():
            setattr(metric, key, value.to(getattr(metric, key).device))
        for key, tail in update.lists.items():
            current = getattr(metric, key)
            del current[update.list_start[key] :]
            current.extend(t.to(device) for t in tail)
        metric._update_count = update.update_count
        metric._computed = None
        metric._forward_cache = to_device(update.forward_cache, device)


def portable_logs(logs: Sequence[LoggedValue], metrics: Mapping[str, nn.Module]) -> list[LoggedValue]:
    """The logs with metric objects replaced by :class:`MetricRef`, ready to pickle."""
    names = {id(m): name for name, m in metrics.items()}
    return [
        LoggedValue(e.name, MetricRef(names.get(id(e.value))) if _is_metric(e.value) else e.value, e.kwargs)
        for e in logs
    ]


def resolve_refs(logs: Sequence[LoggedValue], metrics: Mapping[str, nn.Module]) -> list[LoggedValue]:
    """The logs with each :class:`MetricRef` replaced by this rank's metric object of that name."""
    resolved = []
    for entry in logs:
        value = entry.value
        if isinstance(value, MetricRef):
            if value.name is None:
                raise PipelineUsageError(
                    f"`self.log({entry.name!r}, <metric>)` logged a torchmetrics object that is not an attribute of"
                    " the LightningModule. Under PipelineParallelStrategy metric objects are matched across ranks by"
                    " attribute: assign it (e.g. `self.val_acc = Accuracy(...)`) in `__init__`."
                )
            value = metrics[value.name]
        resolved.append(LoggedValue(entry.name, value, entry.kwargs))
    return resolved
