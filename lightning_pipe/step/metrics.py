"""torchmetrics under a pipeline: exact step values on the last stage, mirrored state on every other rank.

The user's step runs, once per microbatch, only on the rank holding the last stage, so only there do metrics see data.

- **Step values.** ``metric(preds, target)`` per microbatch would leave the last microbatch's value as the step's
  value. While a step runs, a private copy of each metric (its *shadow*, reset at every step) receives the same
  ``update`` calls; its ``compute`` is the value one call on the full batch would have returned, for every metric
  whose repeated updates equal one update on the concatenated inputs (all of torchmetrics' own, including
  ``full_state_update=True`` metrics, max/min/mean reductions and wrappers). That value becomes the metric's step value,
  and a logged forward output of the metric is replaced by it.
- **One observation per call.** ``MeanMetric`` called with one scalar and no weight (``self.train_loss(loss)``) counts
  one observation per call: on one device one per batch, here one per microbatch, so a batch split into more
  microbatches (a short last batch) would weigh more in the epoch mean. During a step each such call is weighted by
  its microbatch's share of the batch's samples: the batch adds the sample mean of its microbatches' values with
  weight 1, as one call on the full batch. (A step returning ``num_items`` is weighted by samples too, not by items.)
- **Mirroring.** After the step the last stage sends the state of every metric that changed (:class:`MetricUpdate`);
  the other ranks assign it, so ``self.log("acc", self.acc)``, ``self.acc.compute()`` in an epoch-end hook and
  callbacks see the same values on every rank. Logged metric objects travel as :class:`MetricRef` (their attribute
  path).

``MetricCollection`` (nested, with prefixes/postfixes, compute groups) needs nothing special: its members are metrics.
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_pipe.compat import torchmetrics as tm_compat
from lightning_pipe.compat.torchmetrics import is_metric, is_metric_container
from lightning_pipe.errors import PipelineUsageError


def find_metrics(module: nn.Module) -> dict[str, nn.Module]:
    """Every ``torchmetrics.Metric`` inside ``module`` (members of collections and wrappers too), by attribute path."""
    return {name: sub for name, sub in module.named_modules() if name and is_metric(sub)}


@dataclass(frozen=True)
class MetricRef:
    """A torchmetrics object named by its attribute path in the LightningModule (the same on every rank)."""

    name: str | None


@dataclass
class MetricUpdate:
    """One metric's state after a step on the last-stage rank, in a form the other ranks can assign.

    Tensor states are sent whole; list states (``dist_reduce_fx="cat"``) only from ``list_start[state]`` on, the
    length every rank's list had before the step.
    """

    name: str
    update_count: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    lists: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    list_start: dict[str, int] = field(default_factory=dict)
    forward_value: Any = None


@dataclass(frozen=True)
class _Before:
    """A metric before a step: update count, identity of each state object, and list lengths."""

    update_count: int
    ids: dict[str, int]
    lengths: dict[str, int]


def _before(metric: Any) -> _Before:
    states = metric.metric_state
    return _Before(
        metric.update_count,
        {k: id(v) for k, v in states.items()},
        {k: len(v) for k, v in states.items() if isinstance(v, list)},
    )


def _changed(metric: Any, before: _Before) -> bool:
    # Every `update` and `forward` increments the count; `reset` zeroes it and replaces tensor states.
    if metric.update_count != before.update_count:
        return True
    states = metric.metric_state
    return any(id(v) != before.ids.get(k) for k, v in states.items() if not isinstance(v, list)) or any(
        len(v) != before.lengths.get(k, 0) for k, v in states.items() if isinstance(v, list)
    )


def bind_metrics(module: nn.Module, group: Any) -> Callable[[], None]:
    """Make metrics without a process group of their own synchronise over ``group`` (the data-parallel replicas);
    returns the undo, which gives them back their own setting when the Trainer entry ends.

    torchmetrics synchronises over all processes by default. Every stage of a pipeline holds the same metric state, so
    a world-wide sync would count each sample once per stage (and hang when only some ranks compute).
    """
    bound = [m for m in find_metrics(module).values() if getattr(m, "process_group", None) is None]
    for metric in bound:
        metric.process_group = group

    def undo() -> None:
        for metric in bound:
            metric.process_group = None

    return undo


def _detached_copy(metric: nn.Module) -> Any:
    """A deep copy of ``metric`` (and the metrics inside it) whose tensors carry no autograd history and whose process
    groups are shared, not copied (deepcopy refuses both non-leaf tensors and process groups)."""
    memo: dict[int, Any] = {}
    for sub in metric.modules():
        group = getattr(sub, "process_group", None)
        if group is not None:
            memo[id(group)] = group
        for value in vars(sub).values():
            leaves = value.values() if isinstance(value, Mapping) else value
            for t in leaves if isinstance(value, (list, tuple, Mapping)) else [value]:
                if isinstance(t, torch.Tensor):
                    memo[id(t)] = t.detach().clone()
    return copy.deepcopy(metric, memo)


class MetricMirror:
    """The metrics of one LightningModule: step values on the last stage, state mirrored to the other ranks."""

    def __init__(self, lightning_module: nn.Module) -> None:
        self.metrics = find_metrics(lightning_module)
        self._names = {id(m): n for n, m in self.metrics.items()}
        self._shadows: dict[str, Any] = {}
        #: per metric called during the step: ids of the leaves of its forward outputs -> (metric, key)
        self._outputs: dict[int, tuple[str, Any]] = {}
        self._keep: list[Any] = []  # forward outputs, alive while their ids are in use
        self._called: set[str] = set()
        self._fractions: list[float] = [1.0]  # each microbatch's share of the step's samples
        self._microbatch = 0  # the microbatch the user's step runs on

    def close(self) -> None:
        """Nothing to undo: the forward hooks live only during a step that records step values (so that the user's
        metrics pickle and deep-copy between steps: a checkpoint holding them, an EMA/SWA callback's copy)."""

    # ------------------------------------------------------------------------------------------------ step values
    def _shadow(self, name: str) -> Any:
        shadow = self._shadows.get(name)
        if shadow is None:
            shadow = _detached_copy(self.metrics[name])
            shadow.reset()
            for sub in shadow.modules():
                if is_metric(sub):
                    tm_compat.never_sync(sub)
            self._shadows[name] = shadow
        return shadow

    def enter(self, microbatch: int) -> None:
        """The user's step is about to run on microbatch ``microbatch`` of the current step."""
        self._microbatch = microbatch

    def _weighed(self, metric: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments of a ``MeanMetric`` call with one scalar and no weight, weighted by the microbatch's share
        of the batch (see the module docstring); any other call's arguments as they are."""
        if not tm_compat.is_mean_metric(metric) or len(self._fractions) == 1 or len(args) > 1 or "weight" in kwargs:
            return args, kwargs
        value = args[0] if args else kwargs.get("value")
        scalar = isinstance(value, numbers.Number) or (isinstance(value, torch.Tensor) and value.numel() == 1)
        return (args, {**kwargs, "weight": self._fractions[self._microbatch]}) if scalar else (args, kwargs)

    def _weigh_calls(self, metric: Any) -> Callable[[], None]:
        """Weigh ``metric``'s updates (its ``forward`` updates through the same attribute) until the returned undo.
        Copies made meanwhile do not keep the wrapper: torchmetrics re-wraps ``update`` when it unpickles."""
        update = metric.__dict__["update"]

        def weighed(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = self._weighed(metric, args, kwargs)
            return update(*args, **kwargs)

        metric.update = weighed

        def undo() -> None:
            metric.update = update

        return undo

    def _after_forward(self, name: str) -> Any:
        def hook(metric: Any, args: tuple, kwargs: dict, output: Any) -> None:
            args, kwargs = self._weighed(metric, args, kwargs)
            self._shadow(name).update(*args, **kwargs)
            self._called.add(name)
            self._keep.append(output)
            if isinstance(output, torch.Tensor):
                self._outputs[id(output)] = (name, None)
            elif isinstance(output, Mapping):
                for key, value in output.items():
                    self._outputs[id(value)] = (name, key)

        return hook

    @contextmanager
    def step(self, record_step_values: bool, sizes: Sequence[int] = (1,)) -> Iterator[StepMetrics]:
        """The metrics during one step on the last-stage rank; ``record_step_values`` when it has several
        microbatches (with one, ``forward`` already returns the batch's value); ``sizes``: the microbatches'
        sample counts (:meth:`StepMetrics.enter` names the one the user's step runs on)."""
        before = {name: _before(m) for name, m in self.metrics.items()}
        self._outputs, self._keep, self._called = {}, [], set()
        self._fractions, self._microbatch = [s / sum(sizes) for s in sizes], 0
        step = StepMetrics(self, before)
        handles = [
            metric.register_forward_hook(self._after_forward(name), with_kwargs=True)
            for name, metric in (self.metrics.items() if record_step_values else ())
        ]
        weighing = len(sizes) > 1
        undos = [self._weigh_calls(m) for m in self.metrics.values() if weighing and tm_compat.is_mean_metric(m)]
        try:
            yield step
        finally:
            for handle in handles:
                handle.remove()
            for undo in undos:
                undo()
            self._fractions = [1.0]

    def settle_step_values(self) -> dict[str, Any]:
        """Step values of the metrics called this step; their forward values become them, shadows are reset."""
        values = {}
        for name in self._called:
            shadow = self._shadows[name]
            value = shadow.compute()
            shadow.reset()
            values[name] = value.detach() if isinstance(value, torch.Tensor) else value
            tm_compat.set_forward_value(self.metrics[name], values[name])
        return values

    def output_source(self, value: Any) -> tuple[str, Any] | None:
        """``(metric name, key)`` when ``value`` is (an entry of) the output of a metric's ``forward`` this step."""
        return self._outputs.get(id(value))

    # ------------------------------------------------------------------------------------------------ mirroring
    def apply(self, updates: Sequence[MetricUpdate], device: torch.device) -> None:
        """Bring this rank's metrics to the last-stage rank's state."""
        for update in updates:
            metric = self.metrics[update.name]
            for key, value in update.tensors.items():
                setattr(metric, key, value.to(getattr(metric, key).device))
            for key, tail in update.lists.items():
                current = getattr(metric, key)
                del current[update.list_start[key] :]
                current.extend(t.to(device) for t in tail)
            tm_compat.set_update_count(metric, update.update_count)
            tm_compat.invalidate(metric)
            tm_compat.set_forward_value(metric, update.forward_value)

    def portable(self, value: Any) -> Any:
        """A logged value ready to send: a metric object becomes a :class:`MetricRef`."""
        if is_metric_container(value):
            return MetricRef(self._names.get(id(value)))
        return value

    def resolve(self, value: Any, log_name: str) -> Any:
        """The inverse of :meth:`portable` on a receiving rank."""
        if not isinstance(value, MetricRef):
            return value
        if value.name is None:
            raise PipelineUsageError(
                f"`self.log({log_name!r}, <metric>)` logged a torchmetrics object that is not an attribute of"
                " the LightningModule. Under PipelineParallelStrategy metric objects are matched across ranks by"
                " attribute: assign it (e.g. `self.val_acc = Accuracy(...)`) in `__init__`."
            )
        return self.metrics[value.name]


class StepMetrics:
    """What happened to the metrics during one step (see :meth:`MetricMirror.step`)."""

    def __init__(self, mirror: MetricMirror, before: Mapping[str, _Before]) -> None:
        self._mirror, self._before = mirror, before
        self.step_values: dict[str, Any] = {}
        #: ``enter(microbatch)``: the user's step is about to run on microbatch ``microbatch`` (its index in the step's
        #: ``sizes``); the mirror's own method (called on every microbatch of the last stage)
        self.enter: Callable[[int], None] = mirror.enter

    def settle(self) -> None:
        self.step_values = self._mirror.settle_step_values()

    def step_value_of(self, logged: Any) -> tuple[bool, Any]:
        """``(True, full-batch value)`` when ``logged`` is (an entry of) a metric's forward output of this step."""
        found = self._mirror.output_source(logged)
        if found is None or found[0] not in self.step_values:
            return False, None
        name, key = found
        value = self.step_values[name]
        return True, value if key is None else value[key]

    def updates(self) -> list[MetricUpdate]:
        """The state of every metric that changed during the step."""
        out = []
        for name, metric in self._mirror.metrics.items():
            before = self._before[name]
            if not _changed(metric, before):
                continue
            update = MetricUpdate(name, metric.update_count, forward_value=tm_compat.forward_value(metric))
            for key, value in metric.metric_state.items():
                if isinstance(value, list):
                    start = before.lengths.get(key, 0) if before.ids.get(key) == id(value) else 0
                    start = start if len(value) >= start else 0
                    update.lists[key] = [t.detach() for t in value[start:]]
                    update.list_start[key] = start
                else:
                    update.tensors[key] = value.detach()
            out.append(update)
        return out
