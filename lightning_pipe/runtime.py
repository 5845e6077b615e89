"""Where the schedule runs: one rank's stages, its torch schedules, and a training step driven through them."""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.config import SINGLE_STAGE, resolve_microbatches
from lightning_pipe.errors import MicrobatchError, PipelineConfigError, PipelineUsageError
from lightning_pipe.interception import CallInterceptor, LoggedValue, _is_metric, merge_microbatch_logs, recording_logs
from lightning_pipe.metrics import (
    apply_updates,
    collect_updates,
    find_metrics,
    portable_logs,
    resolve_refs,
    settle_step_values,
    snapshot,
)
from lightning_pipe.microbatch import batch_size, signature, split_batch

_MAX_CACHED_SCHEDULES = 8


@dataclass
class _Step:
    """What the loss function needs while one schedule step is in flight."""

    hook: str
    microbatches: list[Any]
    extra_args: tuple[Any, ...]
    scale: float
    skip_metadata_call: bool
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    logs: dict[int, list[LoggedValue]] = field(default_factory=dict)


@dataclass
class StepResult:
    """The outcome of one pipeline step, identical on every rank of the pipeline."""

    loss: float | None
    logs: list[LoggedValue]


def _zero_loss(output: Any) -> torch.Tensor:
    # torch infers backward shapes by back-propagating one loss through the first microbatch; any scalar that depends
    # on the output gives the same shapes, and a constant zero keeps the user's step (and its side effects) out of it.
    leaves = [output] if isinstance(output, torch.Tensor) else [t for t in output if isinstance(t, torch.Tensor)]
    return sum((t.float().sum() * 0.0 for t in leaves if t.is_floating_point()), torch.zeros(()))


class PipelineRuntime:
    """Drives this rank's stages through a torch schedule for whole Lightning batches.

    Schedules are cached per batch signature: torch infers stage shapes once per schedule, so a batch of another
    shape (a short last batch, a longer sequence) gets a schedule of its own instead of corrupting the running one.
    """

    def __init__(
        self,
        lightning_module: Any,
        interceptor: CallInterceptor,
        stage_modules: Sequence[tuple[int, nn.Module]],
        num_stages: int,
        stage_ranks: Sequence[int],
        schedule_name: str,
        microbatches: Any,
        microbatch_size: int | None,
        device: torch.device,
        group: dist.ProcessGroup | None,
        group_ranks: Sequence[int],
    ) -> None:
        self.lightning_module = lightning_module
        self.interceptor = interceptor
        self.stage_modules = list(stage_modules)
        self.num_stages = num_stages
        self.stage_ranks = list(stage_ranks)
        self.schedule_name = schedule_name
        self.microbatches = microbatches
        self.microbatch_size = microbatch_size
        self.device = device
        self.group = group
        self.group_ranks = list(group_ranks)
        local = {idx for idx, _ in self.stage_modules}
        self.has_first = 0 in local
        self.has_last = num_stages - 1 in local
        #: global rank of the process that holds the last stage (the source of losses and logs)
        self.last_stage_global_rank = self.group_ranks[self.stage_ranks[num_stages - 1]]
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()
        self._step: _Step | None = None
        #: torchmetrics objects of the LightningModule by attribute path (the same on every rank)
        self.metrics = find_metrics(lightning_module)

    # ----------------------------------------------------------------- schedules
    def _schedule(self, key: tuple, n_microbatches: int, with_loss: bool) -> Any:
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        stages = [
            PipelineStage(module, idx, self.num_stages, self.device, group=self.group)
            for idx, module in self.stage_modules
        ]
        for stage in stages:
            _shapes_only_in_eval_mode(stage)
        cls = get_schedule_class(self.schedule_name)
        loss_fn = self._loss_fn if with_loss else None
        try:
            if self.schedule_name in SINGLE_STAGE:
                schedule = cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
            else:
                schedule = cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        except ValueError as err:
            raise PipelineConfigError(
                f"torch's {self.schedule_name} schedule rejects {n_microbatches} microbatches for {self.num_stages}"
                f" stages: {err}. Change `microbatches` (or the batch size) to satisfy it."
            ) from err
        self._schedules[key] = schedule
        if len(self._schedules) > _MAX_CACHED_SCHEDULES:
            self._schedules.popitem(last=False)
        return schedule

    @staticmethod
    def _needs_metadata(schedule: Any) -> bool:
        flag = getattr(schedule, "_stage_backward_initialized", None)
        if flag is None:
            flag = getattr(schedule, "_stages_backward_initialized", True)
        return not flag

    # ----------------------------------------------------------------- checks
    def _check_same_batch(self, sig: tuple, n_microbatches: int) -> None:
        """Fail loudly, instead of hanging in a send/recv, when the ranks of one pipeline got different batches."""
        if self.group is None or len(self.group_ranks) == 1:
            return
        # crc32, not hash(): str hashes are salted per process.
        mine = torch.tensor([zlib.crc32(repr((sig, n_microbatches)).encode())], dtype=torch.int64)
        everyone = [torch.zeros(1, dtype=torch.int64) for _ in self.group_ranks]
        dist.all_gather(everyone, mine, group=self.group)
        if len({int(t) for t in everyone}) != 1:
            raise MicrobatchError(
                "The ranks of one pipeline received batches of different shapes. Every stage must see the same"
                " batch: use Lightning's default distributed sampler (`use_distributed_sampler=True`) or shard"
                " data only by `trainer.strategy.distributed_sampler_kwargs` (data-parallel rank, not global rank)."
            )

    # ----------------------------------------------------------------- loss
    def _loss_fn(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        step = self._step
        if step is None:
            raise PipelineUsageError("The pipeline's loss function ran outside a step.")
        if step.skip_metadata_call:
            step.skip_metadata_call = False
            return _zero_loss(output)
        index = int(target.reshape(-1)[0])
        result, logs = self.run_user_step(step.hook, step.microbatches[index], step.extra_args, output)
        loss = result.get("loss") if isinstance(result, Mapping) else result
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise PipelineUsageError(
                f"`{step.hook}` must return a scalar loss tensor (or a dict with a 'loss' tensor) under"
                f" PipelineParallelStrategy, got {type(loss).__name__}."
            )
        step.losses[index] = loss.detach()
        step.logs[index] = logs
        return loss * step.scale

    def run_user_step(
        self, hook: str, microbatch: Any, extra_args: tuple[Any, ...], output: Any
    ) -> tuple[Any, list[LoggedValue]]:
        """Run the user's ``hook`` on one microbatch with the network's call answered by ``output``; record its logs."""
        logs: list[LoggedValue] = []
        with self.interceptor.responding(output), recording_logs(self.lightning_module, logs):
            result = getattr(self.lightning_module, hook)(microbatch, *extra_args)
        return result, logs

    # ----------------------------------------------------------------- steps
    def _resolve(self, batch: Any) -> tuple[int, tuple]:
        n = resolve_microbatches(
            self.microbatches, self.microbatch_size, batch_size(batch), self.num_stages, "microbatches"
        )
        return n, signature(batch)

    def train_step(self, batch: Any, extra_args: tuple[Any, ...], accumulate: int) -> StepResult:
        """Forward and backward of one batch through the pipeline; gradients accumulate into ``.grad``."""
        n, sig = self._resolve(batch)
        self._check_same_batch(sig, n)
        schedule = self._schedule(("train", n, sig), n, with_loss=True)
        microbatches = split_batch(batch, n)
        args: tuple[Any, ...] = ()
        kwargs: dict[str, Any] = {}
        if self.has_first:
            self.interceptor.hook = "training_step"
            with recording_logs(self.lightning_module, []):
                args, kwargs = self.interceptor.capture(lambda: self.lightning_module.training_step(batch, *extra_args))
        before = snapshot(self.metrics) if self.has_last else {}
        self._step = _Step(
            hook="training_step",
            microbatches=microbatches,
            extra_args=extra_args,
            scale=1.0 / (n * accumulate),
            skip_metadata_call=self.has_last and self._needs_metadata(schedule),
        )
        try:
            if self.has_last:
                target = torch.arange(n, device=self.device)
                schedule.step(*args, target=target, losses=[], **kwargs)
            else:
                schedule.step(*args, **kwargs)
            step = self._step
        finally:
            self._step = None
        if self.has_last and len(step.losses) != n:
            raise RuntimeError(f"Internal error: the last stage computed {len(step.losses)} of {n} microbatch losses.")
        return self._share_outcome(step, n, before)

    def _share_outcome(self, step: _Step, n: int, before: Mapping[str, Any]) -> StepResult:
        """Broadcast the last stage's loss, logs and metric state changes to every rank of the pipeline."""
        payload: list[Any] = [None]
        local_logs: list[LoggedValue] = []
        if self.has_last:
            loss = float(torch.stack([step.losses[i].float() for i in range(n)]).mean())
            local_logs = merge_microbatch_logs([step.logs[i] for i in range(n)])
            settle_step_values(self.metrics, before)
            payload = [(loss, portable_logs(local_logs, self.metrics), collect_updates(self.metrics, before))]
        if self.group is not None and len(self.group_ranks) > 1:
            dist.broadcast_object_list(payload, src=self.last_stage_global_rank, group=self.group)
        loss, shared, updates = payload[0]
        if self.has_last:
            return StepResult(loss, local_logs)
        # Other ranks mirror the metrics' state, so a logged metric object gives them the last stage's values.
        apply_updates(self.metrics, updates, self.device)
        return StepResult(loss, resolve_refs(shared, self.metrics))

    def replay_logs(self, result: StepResult) -> None:
        """Log, on this rank, the values the last stage's step logged."""
        for entry in result.logs:
            value = entry.value if _is_metric(entry.value) else torch.tensor(entry.value, dtype=torch.float32)
            self.lightning_module.log(entry.name, value, **entry.kwargs)


def _shapes_only_in_eval_mode(stage: Any) -> None:
    """Run torch's one-off shape inference of ``stage`` with its module in eval mode.

    On every stage but the first, torch infers output shapes by running the stage's forward on ``torch.empty`` inputs
    (uninitialised memory). In train mode that pass would fold garbage into BatchNorm's running statistics (NaN in
    later validation); in eval mode buffers are left alone and the shapes are the same.
    """
    infer = getattr(stage, "_forward_metadata_inference", None)
    if infer is None:
        return

    def in_eval_mode(*args: Any, **kwargs: Any) -> Any:
        modes = [(m, m.training) for m in stage.submod.modules()]
        stage.submod.train(False)
        try:
            return infer(*args, **kwargs)
        finally:
            for m, training in modes:
                m.training = training

    stage._forward_metadata_inference = in_eval_mode
