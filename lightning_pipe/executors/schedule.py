"""Training: one ``torch.distributed.pipelining`` schedule step per batch."""

from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import Any, Callable

import torch

from lightning_pipe.config import SINGLE_STAGE, resolve_microbatches
from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.microbatch import batch_size
from lightning_pipe.runtime import PipelineRuntime
from lightning_pipe.side_inputs import INFERENCE, chunk_aware_stage_class

_MAX_CACHED_SCHEDULES = 8

#: ``on_output(microbatch, output) -> loss to back-propagate`` (already scaled)
OnOutput = Callable[[int, Any], torch.Tensor]


def _zero_loss(output: Any) -> torch.Tensor:
    # torch infers backward shapes by back-propagating one loss through the first microbatch; any scalar that depends
    # on the output gives the same shapes, and a constant zero keeps the user's step (and its side effects) out of it.
    leaves = [output] if isinstance(output, torch.Tensor) else [t for t in output if isinstance(t, torch.Tensor)]
    return sum((t.float().sum() * 0.0 for t in leaves if t.is_floating_point()), torch.zeros(()))


def step_options(schedule: Any) -> dict[str, Any]:
    """Keyword arguments for ``schedule.step``: the last stage's outputs are not kept nor merged (each microbatch's
    output already reached the user's step through the loss function), where this torch has ``return_outputs``.

    Checked on the signature: torch versions without the option would pass it to the model as a keyword argument.
    """
    parameters = inspect.signature(type(schedule).step).parameters
    return {"return_outputs": False} if "return_outputs" in parameters else {}


class ScheduleExecutor:
    """Runs a batch's microbatches through a torch schedule; gradients accumulate into the stages' ``.grad``.

    Schedules are cached per microbatch count and call signature: torch infers stage shapes once per schedule, so a
    batch of another shape (a short last batch, a longer sequence) gets a schedule of its own.
    """

    def __init__(
        self, runtime: PipelineRuntime, schedule_name: str, microbatches: Any, microbatch_size: int | None
    ) -> None:
        self.runtime = runtime
        self.schedule_name = schedule_name
        self.microbatches = microbatches
        self.microbatch_size = microbatch_size
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()
        self._on_output: OnOutput | None = None

    def plan(self, batch: Any) -> list[int]:
        """Equal microbatch sizes for ``batch`` (torch's schedules need equal shapes)."""
        size = batch_size(batch)
        n = resolve_microbatches(self.microbatches, self.microbatch_size, size, self.runtime.num_stages, "microbatches")
        return [size // n] * n

    def prepare(self, calls: list, sizes: list[int]) -> list:
        return calls

    def run(self, key: tuple, n: int, on_output: OnOutput | None) -> None:
        schedule, options = self._schedule(key, n)
        self._on_output = on_output
        try:
            if self.runtime.has_last:
                # The target only carries the microbatch index (kept on the CPU: reading it never waits for a GPU).
                schedule.step(target=torch.arange(n), **options)
            else:
                schedule.step(**options)
        except Exception as err:
            # torch wraps an error of a stage's forward in its own RuntimeError; the stage's error is the one to see.
            failure = self.runtime.book.failure
            if failure is not None and failure is not err:
                raise failure from None
            raise
        finally:
            self._on_output = None

    def _schedule(self, key: tuple, n: int) -> tuple[Any, dict[str, Any]]:
        """The schedule for ``key`` and the options of its ``step``."""
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        from torch.distributed.pipelining.schedules import get_schedule_class

        stage_cls = chunk_aware_stage_class()
        runtime = self.runtime
        stages = [
            stage_cls(module, index, runtime.num_stages, runtime.device, group=runtime.group)
            for index, module in runtime.stages.items()
        ]
        cls = get_schedule_class(self.schedule_name)
        try:
            if self.schedule_name in SINGLE_STAGE:
                schedule = cls(stages[0], n, loss_fn=self._loss_fn, scale_grads=False)
            else:
                schedule = cls(stages, n, loss_fn=self._loss_fn, scale_grads=False)
        except ValueError as err:
            raise PipelineConfigError(
                f"torch's {self.schedule_name} schedule rejects {n} microbatches for {runtime.num_stages}"
                f" stages: {err}. Change `microbatches` (or the batch size) to satisfy it."
            ) from err
        self._schedules[key] = (schedule, step_options(schedule))
        if len(self._schedules) > _MAX_CACHED_SCHEDULES:
            self._schedules.popitem(last=False)
        return self._schedules[key]

    def _loss_fn(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        last = self.runtime.last_stage
        if last.last_forward == INFERENCE:
            # torch's backward shape inference, right after its forward shape inference (not a real microbatch).
            last.last_forward = None
            return _zero_loss(output)
        microbatch = int(target)  # a one-element chunk of torch.arange(n)
        if last.last_forward != microbatch or self._on_output is None:
            raise RuntimeError(
                f"Internal error: loss of microbatch {microbatch} requested after the last stage ran"
                f" {last.last_forward!r}."
            )
        recorder = last.recorder
        if recorder is None:
            return self._on_output(microbatch, last.final_output(microbatch, output))
        start = recorder.now()
        loss = self._on_output(microbatch, last.final_output(microbatch, output))
        recorder.compute("L", last.index, microbatch, start)
        return loss

    def reset(self) -> None:
        """Forget cached schedules (their stages are bound to a process group that may be gone)."""
        self._schedules.clear()
