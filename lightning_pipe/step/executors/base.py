"""The executor protocol: how a step's microbatches run through this rank's stages."""

from __future__ import annotations

from typing import Protocol

from lightning_pipe.step.stage import StepContext


class Executor(Protocol):
    """Runs one step's microbatches through this rank's stages. Training plugs in the torch schedule
    (:class:`~lightning_pipe.step.executors.schedule.ScheduleExecutor`), evaluation the forward-only pass
    (:class:`~lightning_pipe.step.executors.forward_only.ForwardOnlyExecutor`); the step protocol does the rest.

    An executor keeps only what outlives a step (cached schedules, settings); everything about the step in flight is
    in the :class:`StepContext` it is handed.
    """

    #: whether :meth:`run` calls ``step.on_receive`` where this rank waits for another (else the caller posts what it
    #: expects before the step)
    reports_receives: bool

    def plan(self, size: int) -> list[int]:
        """The microbatch sizes of a batch of ``size`` samples."""
        ...

    def run(self, key: tuple, step: StepContext) -> None:
        """Run the step's microbatches (``step.calls``); on the last stage hand each microbatch's output to
        ``step.on_output(microbatch, output)``. ``key`` identifies the step's shapes (equal keys: equal shapes)."""
        ...
