"""How a step's microbatches run through the stages: the torch schedule (training) or a forward-only pass (evaluation).

Both take the network calls already in the rank's :class:`~lightning_pipe.side_inputs.CallBook` and hand the last
stage's output of each microbatch to ``on_output(microbatch, output)``; the step protocol does the rest.
"""

from lightning_pipe.executors.forward_only import ForwardOnlyExecutor
from lightning_pipe.executors.schedule import ScheduleExecutor

__all__ = ["ForwardOnlyExecutor", "ScheduleExecutor"]
