"""The step protocol: every training, validation, test and predict step of a pipelined LightningModule runs as

    capture -> execute -> settle -> share -> replay

1. **capture** (every rank): split the batch into microbatches and run the user's step on each until it calls the
   network; the calls go into the rank's call book (the pipeline's input and every stage's side inputs).
2. **execute**: an executor runs the microbatches through the stages (training: the torch schedule; evaluation: the
   forward-only pass). On the last stage each microbatch's output answers the network call of one more run of the
   user's step, which computes the loss (back-propagated by the schedule) and logs.
3. **settle** (last stage): the step's loss, logs, metric step values and outputs for the whole batch
   (:mod:`lightning_pipe.step.merging`, :mod:`lightning_pipe.step.metrics`).
4. **share**: one collective per step sends that outcome to every rank of the pipeline
   (:mod:`lightning_pipe.step.sharing`).
5. **replay** (every rank): metric state mirrored, the step's logs logged, so loggers, the progress bar and callbacks
   see the same values on every rank.

Training and evaluation differ only in the executor they plug in; the Trainer and a Fabric loop only in the front end
that says what the user's step is (:mod:`lightning_pipe.step.frontend`: a LightningModule hook, or a function).
"""

from __future__ import annotations

import functools
import warnings
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_pipe.comm import collectives
from lightning_pipe.comm.dtensor import full
from lightning_pipe.errors import MicrobatchError, PipelineUsageError
from lightning_pipe.microbatch import batch_size, signature, split_batch
from lightning_pipe.models.huggingface.loss_items import Counted, items_of
from lightning_pipe.step.executors.base import Executor
from lightning_pipe.step.executors.forward_only import ForwardOnlyExecutor
from lightning_pipe.step.frontend import TRAINING, UserStep
from lightning_pipe.step.generation import Lockstep, decoding_of
from lightning_pipe.step.interception import Call, CallInterceptor, LoggedValue
from lightning_pipe.step.manual import ManualResult, Op, agreed_ops
from lightning_pipe.step.merging import (
    converted,
    is_scalar_structure,
    merge_device,
    merge_microbatch_logs,
    merge_outputs,
    weighted_mean,
)
from lightning_pipe.step.metrics import MetricMirror, MetricUpdate, StepMetrics
from lightning_pipe.step.rng import RngStreams
from lightning_pipe.step.runtime import PipelineRuntime
from lightning_pipe.step.sharing import OutcomeChannel
from lightning_pipe.step.stage import StepContext
from lightning_pipe.step.token_mean import counted_items, uneven_ignored, uneven_ignored_message
from lightning_pipe.structures import map_structure, map_tensors

NUM_ITEMS = "num_items"
DIFFERENT_BATCHES = (
    "The ranks of one pipeline received batches of different shapes. Every stage must see the same batch: use"
    " Lightning's default distributed sampler (`use_distributed_sampler=True`) or shard data only by"
    " `trainer.strategy.distributed_sampler_kwargs` (data-parallel rank, not global rank)."
)


@dataclass
class Outcome:
    """What a step produced, identical on every rank of the pipeline after :meth:`StepProtocol.run`."""

    #: the step's loss (training), averaged over the batch as one device would have
    loss: torch.Tensor | None = None
    #: ``1 / total num_items`` when the step returned ``num_items`` (gradients are scaled by it), else ``None``
    grad_scale: float | None = None
    logs: list[LoggedValue] = field(default_factory=list)
    metric_updates: list[MetricUpdate] = field(default_factory=list)
    #: the merged step output where it holds only scalars (every rank), else only on the last-stage rank
    output: Any = None
    output_shared: bool = False
    #: checksum of the step's microbatching and call shapes on the last-stage rank
    key_checksum: int = 0
    #: a manual-optimization training step's optimizer calls, for every rank to do once (:mod:`.manual`)
    manual_ops: tuple[Op, ...] | None = None


@dataclass
class _Record:
    """The last stage's per-microbatch results while a step runs."""

    results: dict[int, Any] = field(default_factory=dict)
    logs: dict[int, list[LoggedValue]] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    items: dict[int, torch.Tensor | None] = field(default_factory=dict)
    #: the items a microbatch's loss averages over, counted by the strategy (the model's own token-mean loss)
    counted: dict[int, torch.Tensor | None] = field(default_factory=dict)
    #: per microbatch, the logged values that are the model's own token-mean loss, with its items
    logged_items: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: a manual-optimization step's optimizer calls per microbatch
    ops: dict[int, tuple[Op, ...]] = field(default_factory=dict)
    #: how many microbatches returned a bare loss with nothing counted (the usual training step)
    bare: int = 0


@functools.lru_cache(maxsize=64)
def _checksum(key: tuple) -> int:
    # crc32, not hash(): str hashes are salted per process. Cached: a run has a handful of keys, seen every step.
    return zlib.crc32(repr(key).encode())


class StepProtocol:
    """Runs the user's step (:class:`~lightning_pipe.step.frontend.UserStep`) on one batch through the pipeline (see
    the module docstring)."""

    def __init__(
        self,
        runtime: PipelineRuntime,
        interceptor: CallInterceptor,
        mirror: MetricMirror,
        rng: RngStreams,
        count_items: bool = True,
    ) -> None:
        self.runtime = runtime
        #: weight a microbatch by the items of the model's own token-mean loss when the step returns that loss
        self.count_items = count_items
        #: shape keys whose batches were checked for ignore values in uneven counts (:meth:`_notice_uneven`)
        self._uneven_checked: set[int] = set()
        self._uneven_said = False
        self.interceptor = interceptor
        self.mirror = mirror
        self.rng = rng
        self.channel = OutcomeChannel(runtime.group, runtime.last_stage_global_rank, runtime.device)
        self._agreed: set[int] = set()

    def close(self) -> None:
        """Take off what this protocol installed on the user's objects (the network's call interceptor, the metrics'
        hooks) and wait for its last sends."""
        self.interceptor.remove()
        self.mirror.close()
        self.channel.close()

    def run(self, user_step: UserStep, batch: Any, executor: Executor, accumulate: int = 1) -> Outcome:
        """Run ``user_step`` on ``batch``; on the last stage each training microbatch's loss is scaled for
        ``accumulate`` accumulated batches (Lightning's own division happens before the schedule's backward)."""
        runtime = self.runtime
        hook = user_step.hook
        if not executor.reports_receives:
            self.channel.expect()
        size = batch_size(batch)
        sizes = executor.plan(size)
        n = len(sizes)
        microbatches = split_batch(batch, n, sizes, size=size)
        self.interceptor.step_name = user_step.name
        with self.rng.compute():
            calls = self._capture(user_step, microbatches)
            key = (hook == TRAINING, n, tuple([_call_signature(c) for c in calls]))
            checksum = _checksum(key)
            self._check_agreement(checksum)
            # The outcome's receive is posted where this rank first waits for another inside the schedule (posting it
            # takes about 0.1 ms of CPU; before the step it delayed the first forward, which the next stage waits for).
            step = StepContext(calls, sizes, on_receive=self.channel.expect if self.channel.receives else None)
            local = None
            if self.interceptor.captured_generate:  # (any call's `generate`, without a walk over them)
                local = self._generating(user_step, batch, executor, checksum)
            elif runtime.has_last:
                record = _Record()
                scale = 1.0 / (n * accumulate)
                with self.mirror.step(record_step_values=n > 1, sizes=sizes) as metrics:

                    def on_output(m: int, output: Any) -> Any:
                        metrics.enter(m)
                        seen = step.counted.get(m, [])
                        return self._microbatch(user_step, microbatches[m], output, m, record, scale, accumulate, seen)

                    step.on_output = on_output
                    try:
                        executor.run(key, step)
                    finally:
                        # on_output holds the step: a reference cycle, which would keep the step's tensors until the
                        # garbage collector ran (and make it run more often)
                        step.on_output = None
                    # Settled and sent after the schedule, not as soon as the last microbatch's loss is known: work
                    # there delays the last backwards, which the other stages wait for (measured: +1.2 ms a step on
                    # the small benchmark network). The other ranks posted their receive inside the schedule.
                    local = self._settle(user_step, record, sizes, metrics, checksum)
                if hook == TRAINING and local.grad_scale is None:
                    self._notice_uneven(user_step.name, microbatches, checksum)
            else:
                executor.run(key, step)
        shared = self.channel.share(self._portable(local) if local is not None else None)
        if shared.key_checksum != checksum:
            raise MicrobatchError(DIFFERENT_BATCHES)
        outcome = local if local is not None else shared
        if local is None:
            self.mirror.apply(shared.metric_updates, runtime.device)
        self._replay(user_step, outcome.logs)
        return outcome

    # ------------------------------------------------------------------------------------------------ capture
    def _capture(self, user_step: UserStep, microbatches: list[Any]) -> list[Call]:
        # Logs of these partial runs are dropped: the full runs on the last stage log.
        with user_step.recording_logs([]):
            return self.interceptor.capture_each(user_step, microbatches)

    def _check_agreement(self, checksum: int) -> None:
        """Before the first step of each new shape (``checksum`` of its key): fail loudly, instead of hanging in a
        send/recv, when the ranks of one pipeline got batches of different shapes. (Later steps are checked after the
        fact by the outcome.)"""
        if checksum in self._agreed or self.runtime.pipeline_size == 1:
            return
        mine = torch.tensor([checksum], dtype=torch.int64)
        everyone = collectives.all_gather(mine, self.runtime.group)
        if len({int(t) for t in everyone}) != 1:
            raise MicrobatchError(DIFFERENT_BATCHES)
        self._agreed.add(checksum)

    # ------------------------------------------------------------------------------------------------ generating
    def _generating(self, user_step: UserStep, batch: Any, executor: Executor, checksum: int) -> Outcome | None:
        """A step that generates: every rank runs it on the whole batch in lockstep
        (:mod:`lightning_pipe.step.generation`); the last stage settles it as a one-microbatch step."""
        network = self.interceptor.module
        decoding = decoding_of(network, self.runtime, user_step.hook)
        assert isinstance(executor, ForwardOnlyExecutor)
        # Sampling draws from the compute stream: the same numbers on every rank, so every rank picks the same tokens.
        self.rng.agree(self.runtime.group, self.runtime.last_stage_global_rank)
        self.rng.agree_device(self.runtime.group, self.runtime.last_stage_global_rank, self.runtime.device)
        driver = Lockstep(self.runtime, executor, network, decoding)
        logs: list[LoggedValue] = []
        if not self.runtime.has_last:
            with self.interceptor.lockstep(driver.answer, driver.generate), user_step.recording_logs(logs):
                user_step(batch)
            return None
        record = _Record()
        with self.mirror.step(record_step_values=False) as metrics:
            with self.interceptor.lockstep(driver.answer, driver.generate), user_step.recording_logs(logs):
                result = user_step(batch)
            record.logs[0] = [LoggedValue(e.name, _whole(e.value), e.kwargs) for e in logs]
            record.results[0] = result = _whole(result)
            items = result.get(NUM_ITEMS) if isinstance(result, Mapping) else None
            record.items[0] = None if items is None else torch.as_tensor(items).detach()
            return self._settle(user_step, record, [batch_size(batch)], metrics, checksum)

    # ------------------------------------------------------------------------------------------------ last stage
    def run_user_step(self, user_step: UserStep, microbatch: Any, output: Any) -> tuple[Any, list]:
        """Run the user's step on one microbatch with the network's call answered by ``output``; record its logs."""
        logs: list[LoggedValue] = []
        with self.interceptor.responding(output), user_step.recording_logs(logs):
            result = user_step(microbatch)
        return result, [LoggedValue(e.name, _whole(e.value), e.kwargs) for e in logs] if logs else logs

    def _microbatch(
        self,
        user_step: UserStep,
        microbatch: Any,
        output: Any,
        m: int,
        record: _Record,
        scale: float,
        accumulate: int,
        seen: list[Counted],
    ) -> Any:
        result, logs = self.run_user_step(user_step, microbatch, output)
        record.logs[m] = logs
        if seen and self.count_items:
            found = {e.name: items_of(e.value, seen) for e in logs}
            record.logged_items[m] = {name: items for name, items in found.items() if items is not None}
        hook = user_step.hook
        if hook != TRAINING:
            if self.count_items:
                record.counted[m] = items_of(result.get("loss") if isinstance(result, Mapping) else result, seen)
            record.results[m] = result = _whole(result)
            items = result.get(NUM_ITEMS) if isinstance(result, Mapping) else None
            record.items[m] = None if items is None else torch.as_tensor(items).detach()
            return None
        if type(result) is torch.Tensor and result.dim() == 0 and not seen:
            # The usual training step: a bare loss, nothing counted by the model (what the general case below does
            # for it, in fewer steps: this runs between the last stage's forward and backward of every microbatch).
            record.losses[m] = record.results[m] = result
            record.bare += 1
            return result * scale if scale != 1.0 else result
        if isinstance(result, ManualResult):  # the loss is the one given to `manual_backward`
            loss, items, record.ops[m] = result.loss, None, result.ops
            record.results[m] = _whole(result.output)
        else:
            loss, items = _loss_and_items(user_step.name, result)
            if items is None and self.count_items:
                # Counted only where the step returns no num_items of its own: never both.
                record.counted[m] = items_of(loss, seen)
        # The loss keeps its graph (a DTensor under loss parallelism) for backward; everything recorded is whole, and
        # detached when the step settles (not here, between the last stage's forward and backward).
        record.losses[m], record.items[m] = full(loss), items
        if m not in record.ops:
            record.results[m] = {**_whole(result), "loss": record.losses[m]} if isinstance(result, Mapping) else loss
        counted = record.counted.get(m)
        if items is None and counted is None:
            return loss * scale if scale != 1.0 else loss
        if items is None:
            # The model's own mean over this microbatch's items (a transformers loss from `labels=`): weighted like a
            # step that returns them as num_items (their sum is known at settle, which checks every microbatch was).
            return loss * counted.to(loss.dtype) / accumulate
        # Token-weighted: the sum of this microbatch's item losses; gradients are divided by the batch's total
        # num_items once it is known (Outcome.grad_scale), which gives the batch's item mean as on one device.
        return loss * items.to(loss.dtype) / accumulate

    def _settle(
        self, user_step: UserStep, record: _Record, sizes: list[int], metrics: StepMetrics, checksum: int
    ) -> Outcome:
        hook, n = user_step.hook, len(sizes)
        # The usual training step (every microbatch a bare loss, nothing counted nor logged as counted): weighted by
        # the microbatches' sizes, without the checks below (what they conclude for it).
        usual = hook == TRAINING and record.bare == n
        weighted = False
        if not usual:
            items = [record.items.get(m) for m in range(n)]
            weighted = _check_items(user_step.name, items)
            if not weighted:
                counted = counted_items(user_step.name, [record.counted.get(m) for m in range(n)])
                if counted is not None:
                    items, weighted = counted, _check_items(user_step.name, counted)
        weights = [float(i) for i in items] if weighted else [float(s) for s in sizes]
        metrics.settle()
        logs = merge_microbatch_logs(
            [record.logs[m] for m in range(n)],
            weights=weights,
            step_value_of=metrics.step_value_of,
            weights_of=None if weighted or usual else _logged_items(record, n),
        )
        outcome = Outcome(logs=logs, metric_updates=metrics.updates(), key_checksum=checksum)
        if hook == TRAINING:
            outcome.loss = _weighted_mean([record.losses[m].detach() for m in range(n)], weights)
            if weighted:
                outcome.grad_scale = 1.0 / sum(weights)
        manual = bool(record.ops)
        if manual:
            outcome.manual_ops = agreed_ops(user_step.name, [record.ops[m] for m in range(n)])
        if (
            hook == TRAINING
            and not manual
            and (usual or not any(isinstance(r, Mapping) for r in record.results.values()))
        ):
            # A bare loss (the usual training step): the step's output is the loss just computed.
            output: Any = outcome.loss
        else:
            results = [map_structure(record.results[m], _detached) for m in range(n)]
            output = merge_outputs(results, weights, hook)
            if hook == TRAINING and not manual:  # manual optimization: what the step returned, as on one device
                output = {**output, "loss": outcome.loss}
        outcome.output = output
        outcome.output_shared = hook != "predict_step" and is_scalar_structure(output)
        return outcome

    def _portable(self, outcome: Outcome) -> Outcome:
        """The outcome as the other ranks receive it: metric objects as references, bulky outputs left out."""
        return Outcome(
            loss=outcome.loss,
            grad_scale=outcome.grad_scale,
            logs=[LoggedValue(e.name, self.mirror.portable(e.value), e.kwargs) for e in outcome.logs],
            metric_updates=outcome.metric_updates,
            output=outcome.output if outcome.output_shared else None,
            output_shared=outcome.output_shared,
            key_checksum=outcome.key_checksum,
            manual_ops=outcome.manual_ops,
        )

    def _notice_uneven(self, name: str, microbatches: list[Any], checksum: int) -> None:
        """Say once when a step weighted equally returned a loss over a batch whose integer tensors hold the ignore
        value in uneven counts per microbatch (checked on the first batch of each shape: counting costs a host sync)."""
        if self._uneven_said or checksum in self._uneven_checked:
            return
        self._uneven_checked.add(checksum)
        found = uneven_ignored(microbatches)
        if found is not None:
            self._uneven_said = True
            warnings.warn(uneven_ignored_message(name, *found), UserWarning, stacklevel=2)

    # ------------------------------------------------------------------------------------------------ replay
    def _replay(self, user_step: UserStep, logs: list[LoggedValue]) -> None:
        """Log, on this rank, the values the last stage's step logged."""
        device = self.runtime.device
        for entry in logs:
            value = self.mirror.resolve(entry.value, entry.name)
            if isinstance(value, torch.Tensor):
                value = value.to(device)
            user_step.log(entry, value)


def _call_signature(call: Call) -> tuple:
    """The shapes and dtypes of ``call``'s tensors (:func:`~lightning_pipe.microbatch.signature`); the usual call, one
    tensor and no keywords, without the walk (this runs for every microbatch on every rank)."""
    args = call.args
    if len(args) == 1 and not call.kwargs and type(args[0]) is torch.Tensor:
        return ((args[0].shape, args[0].dtype),)
    return signature((args, call.kwargs))


def _weighted_mean(losses: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The microbatch losses' mean weighted by ``weights``, computed in float64 (on the CPU where the device has none),
    in the losses' dtype and on their device; the weights enter as Python numbers, so nothing is copied to the device
    nor read back (:func:`~lightning_pipe.step.merging.weighted_mean`)."""
    if len(losses) == 1:  # one microbatch: the mean of one value is that value (as the float64 round trip gives)
        return losses[0]
    device = merge_device(losses)
    if all(w == weights[0] for w in weights):
        mean = converted(torch.stack(losses), device, torch.float64).mean()
    else:
        mean = weighted_mean([converted(loss, device, torch.float64) for loss in losses], weights)
    return converted(mean, losses[0].device, losses[0].dtype)


def _whole(value: Any) -> Any:
    """``value`` with every DTensor in it (a tensor-parallel output, a loss-parallel loss) made whole, so that it
    merges, travels and logs as on one device."""
    return map_tensors(value, full)


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _loss_and_items(name: str, result: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if type(result) is torch.Tensor and result.dim() == 0:  # the usual step's result: a bare loss
        return result, None
    loss = result.get("loss") if isinstance(result, Mapping) else result
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise PipelineUsageError(
            f"`{name}` must return a scalar loss tensor (or a dict with a 'loss' tensor) under"
            f" PipelineParallelStrategy, got {type(loss).__name__}."
        )
    items = result.get(NUM_ITEMS) if isinstance(result, Mapping) else None
    if items is None:
        return loss, None
    items = torch.as_tensor(items, device=loss.device).detach()
    if items.numel() != 1 or items.is_floating_point() and bool(items != items.round()):
        raise PipelineUsageError(
            f"`{name}` returned `num_items={items.tolist()}`; it must be the number of items (e.g. tokens) the loss"
            " averages over: one non-negative integer, e.g. `(labels != -100).sum()`."
        )
    return loss, items.reshape(())


def _logged_items(record: _Record, n: int) -> dict[str, list[float]]:
    """The logged names that hold the model's own token-mean loss in every microbatch, with its items per
    microbatch: merged as one device's mean over the batch's items, whatever weights the step's other values."""
    found = [record.logged_items.get(m, {}) for m in range(n)]
    names = set(found[0]).intersection(*found[1:]) if found else set()
    return {name: [float(f[name]) for f in found] for name in names}


def _check_items(name: str, items: list[torch.Tensor | None]) -> bool:
    """Whether the step weighted its microbatches by ``num_items`` (all of them, or none)."""
    given = [i is not None for i in items]
    if any(given) and not all(given):
        raise PipelineUsageError(
            f"`{name}` returned `num_items` for some microbatches of a batch but not for others. Return it from every"
            " step (or from none)."
        )
    if all(given) and items and float(sum(float(i) for i in items)) <= 0:  # type: ignore[arg-type]
        raise PipelineUsageError(
            f"`{name}` returned `num_items` that sum to 0 over the batch, so its item mean is undefined. Batches"
            " need at least one counted item (e.g. one label that is not -100)."
        )
    return bool(items) and all(given)
