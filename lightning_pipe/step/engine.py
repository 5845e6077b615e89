"""What one Trainer entry (or Fabric setup) runs its steps with: this rank's stages, the step protocol and its two
executors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from lightning_pipe.comm.dtensor import submesh_lookup
from lightning_pipe.parallel.tensor_parallel import loss_parallel_context
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.split.builder import Split
from lightning_pipe.step.executors import ForwardOnlyExecutor, ScheduleExecutor
from lightning_pipe.step.frontend import UserStep
from lightning_pipe.step.interception import CallInterceptor
from lightning_pipe.step.metrics import MetricMirror
from lightning_pipe.step.protocol import Outcome, StepProtocol
from lightning_pipe.step.rng import RngStreams
from lightning_pipe.step.runtime import PipelineRuntime, stage_modules

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class StepEngine:
    """Built once per Trainer entry (or Fabric ``setup_module``) from the split (:mod:`lightning_pipe.split`);
    :meth:`close` removes everything it installed on ``owner`` (the LightningModule, or the module a Fabric loop set
    up): the network's call interceptor, the metrics' hooks. ``outside``: the message for a network call outside any
    step (default: the Trainer's)."""

    def __init__(
        self,
        owner: Any,
        split: Split,
        settings: PipelineSettings,
        pipeline_group: Any,
        device: torch.device,
        rng: RngStreams,
        mesh: DeviceMesh,
        outside: str = "",
    ) -> None:
        self.runtime = PipelineRuntime(
            stage_modules(split), split.num_stages, split.stage_ranks, pipeline_group, device, submesh_lookup(mesh)
        )
        interceptor = CallInterceptor(split.network, outside)
        # Under FSDP a counted token mean would be refused like a returned `num_items` where replicas count unlike
        # (data_parallel.check_token_weighting): the strategy counts only where that weighting always applies.
        count_items = not settings.sharded
        self.protocol = StepProtocol(self.runtime, interceptor, MetricMirror(owner), rng, count_items)
        self.training = ScheduleExecutor(self.runtime, settings)
        self.evaluation = ForwardOnlyExecutor(self.runtime, settings, split.static_microbatch_size)
        self.loss_parallel = settings.loss_parallel and settings.tensor_parallel_size > 1

    def train(self, user_step: UserStep, batch: Any, accumulate: int = 1) -> Outcome:
        """One training step: a schedule step over the batch's microbatches."""
        with loss_parallel_context(self.loss_parallel):
            return self.protocol.run(user_step, batch, self.training, accumulate)

    def evaluate(self, user_step: UserStep, batch: Any) -> Outcome:
        """One validation, test or predict step: a forward-only pass."""
        with loss_parallel_context(self.loss_parallel):
            return self.protocol.run(user_step, batch, self.evaluation)

    @property
    def synchronized(self) -> bool:
        """Whether this step's gradients are synchronised at its end (outside :meth:`unsynchronized`)."""
        return all(stage.sync_gradients for stage in self.runtime.stages.values())

    @contextmanager
    def unsynchronized(self) -> Iterator[None]:
        """Inside: the stages' FSDP reduction waits (the batches of an accumulation window before its last)."""
        stages = list(self.runtime.stages.values())
        for stage in stages:
            stage.sync_gradients = False
        try:
            yield
        finally:
            for stage in stages:
                stage.sync_gradients = True

    def close(self) -> None:
        self.protocol.close()
