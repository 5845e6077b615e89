"""The step protocol's front ends: what "the user's step" is, for the Trainer and for a Fabric loop.

The protocol (:mod:`lightning_pipe.step.protocol`) runs the user's step once per microbatch, twice over (capture on
every rank, respond on the last stage's), records what it logs and replays those logs on every rank. A front end
tells it how to run that step and where its logs go:

- :class:`HookStep`: a LightningModule hook (``training_step``, ``validation_step``, ...) with its extra arguments;
  ``self.log`` calls are recorded and replayed through the LightningModule.
- :class:`FunctionStep`: a function of the batch (Fabric's ``loss = model.step(fn, batch)``); it logs nothing through
  the protocol (a Fabric loop logs the returned loss itself, which every rank receives).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

from lightning_pipe.step.interception import LoggedValue, RecordingLogs

TRAINING = "training_step"


class UserStep(Protocol):
    """The user's step as the protocol runs it."""

    #: which kind of step it is, by Lightning's hook names (``"training_step"``: the schedule back-propagates its loss)
    hook: str
    #: how messages name it
    name: str

    def __call__(self, microbatch: Any) -> Any:
        """Run the step on one microbatch."""
        ...

    def recording_logs(self, sink: list[LoggedValue]) -> AbstractContextManager[Any]:
        """Within the block, what the step logs goes into ``sink``."""
        ...

    def log(self, entry: LoggedValue, value: Any) -> None:
        """Log ``value`` (``entry``'s value made local) on this rank, as the step logged it on the last stage."""
        ...


@dataclass
class HookStep:
    """A LightningModule hook, called as ``hook(microbatch, *extra_args)``."""

    module: Any
    hook: str
    extra_args: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        # Looked up once: a HookStep lives for one step, and runs its hook twice per microbatch.
        self.method = getattr(self.module, self.hook)

    @property
    def name(self) -> str:
        return self.hook

    def __call__(self, microbatch: Any) -> Any:
        return self.method(microbatch, *self.extra_args)

    def recording_logs(self, sink: list[LoggedValue]) -> AbstractContextManager[Any]:
        return RecordingLogs(self.module, sink)

    def log(self, entry: LoggedValue, value: Any) -> None:
        self.module.log(entry.name, value, **entry.kwargs)


@dataclass
class FunctionStep:
    """A training step given as a function of the (micro)batch that calls the network once and returns its loss (or
    a dict with ``"loss"`` and optionally ``"num_items"``)."""

    fn: Callable[[Any], Any]
    name: str = "the step function"
    hook: str = TRAINING
    #: the context ``fn`` runs in (Fabric runs a loop's own code outside the precision's forward context)
    context: Callable[[], AbstractContextManager[Any]] = nullcontext

    def __call__(self, microbatch: Any) -> Any:
        with self.context():
            return self.fn(microbatch)

    def recording_logs(self, sink: list[LoggedValue]) -> AbstractContextManager[Any]:
        return nullcontext()

    def log(self, entry: LoggedValue, value: Any) -> None:
        """Never called: nothing is recorded (:meth:`recording_logs`), so there is nothing to replay."""
