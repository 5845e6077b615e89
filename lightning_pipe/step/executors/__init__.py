"""How a step's microbatches run through the stages: the torch schedule (training) or a forward-only pass (evaluation).

Both implement :class:`~lightning_pipe.step.executors.base.Executor`: they take the network calls in the step's
:class:`~lightning_pipe.step.stage.StepContext` and hand the last stage's output of each microbatch to its
``on_output(microbatch, output)``; the step protocol does the rest.
"""

from lightning_pipe.step.executors.base import Executor
from lightning_pipe.step.executors.forward_only import ForwardOnlyExecutor
from lightning_pipe.step.executors.schedule import ScheduleExecutor

__all__ = ["Executor", "ForwardOnlyExecutor", "ScheduleExecutor"]
