"""What one Trainer entry runs its steps with: this rank's stages, the step protocol and its two executors."""

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
from lightning_pipe.step.interception import CallInterceptor
from lightning_pipe.step.metrics import MetricMirror
from lightning_pipe.step.protocol import Outcome, StepProtocol
from lightning_pipe.step.rng import RngStreams
from lightning_pipe.step.runtime import PipelineRuntime, stage_modules

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class StepEngine:
    """Built once per Trainer entry from the split (:mod:`lightning_pipe.split`); :meth:`close` removes everything
    it installed on the LightningModule (the network's call interceptor, the metrics' hooks)."""

    def __init__(
        self,
        lightning_module: Any,
        split: Split,
        settings: PipelineSettings,
        pipeline_group: Any,
        device: torch.device,
        rng: RngStreams,
        mesh: DeviceMesh,
    ) -> None:
        self.runtime = PipelineRuntime(
            stage_modules(split), split.num_stages, split.stage_ranks, pipeline_group, device, submesh_lookup(mesh)
        )
        self.protocol = StepProtocol(
            lightning_module,
            self.runtime,
            CallInterceptor(split.network),
            MetricMirror(lightning_module),
            rng,
        )
        self.training = ScheduleExecutor(self.runtime, settings)
        self.evaluation = ForwardOnlyExecutor(self.runtime, settings, split.static_microbatch_size)
        self.loss_parallel = settings.loss_parallel and settings.tensor_parallel_size > 1

    def train(self, batch: Any, extra_args: tuple[Any, ...], accumulate: int) -> Outcome:
        """One training step: a schedule step over the batch's microbatches."""
        with loss_parallel_context(self.loss_parallel):
            return self.protocol.run("training_step", batch, extra_args, self.training, accumulate)

    def evaluate(self, hook: str, batch: Any, extra_args: tuple[Any, ...]) -> Outcome:
        """One validation, test or predict step: a forward-only pass."""
        with loss_parallel_context(self.loss_parallel):
            return self.protocol.run(hook, batch, extra_args, self.evaluation)

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
