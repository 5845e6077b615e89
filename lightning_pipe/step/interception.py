"""How the user's unchanged steps run under a pipeline: the network call is intercepted, ``self.log`` recorded.

The pipelined network is never called as a whole. Its ``forward`` is replaced by a :class:`CallInterceptor`:

- in *capture* mode, the user's step runs until it calls the network; the interceptor records the call's arguments
  and stops the step (every rank does this for every microbatch: that call is the pipeline's input and the source of
  each stage's side inputs);
- in *respond* mode, on the rank holding the last stage, the user's step runs once per microbatch and the
  interceptor returns that microbatch's pipeline output, from which the step computes its loss and logs.

``self.log`` calls made during those runs are recorded (:func:`recording_logs`); the step protocol merges them over
microbatches and replays them once, on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from lightning_pipe.compat.lightning import called_from_model_summary
from lightning_pipe.compat.torchmetrics import is_metric_container
from lightning_pipe.errors import PipelineUsageError


@dataclass
class Call:
    """The arguments of one call of the pipelined network."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _InputsCaptured(BaseException):
    """Ends the user's step at the network call (a BaseException, so ``except Exception`` cannot swallow it)."""


class CallInterceptor:
    """Stands in for the pipelined network's ``forward`` while the strategy runs a step."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.hook = "training_step"
        self._mode = "off"
        self._output: Any = None
        self._used = False
        self._captured: Call | None = None
        # An instance attribute shadows the class's forward; nn.Module.__call__ looks it up on the instance.
        module.forward = self  # type: ignore[method-assign]

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        # A pickled or deep-copied network (kept in `save_hyperparameters()`, copied by an EMA/SWA callback) gets its
        # class's forward back: the copy is not run by the strategy, and the interceptor's state is one step's.
        return _class_forward, (self.module,)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._mode == "capture":
            self._captured = Call(args, kwargs)
            raise _InputsCaptured
        if self._mode == "respond":
            if self._used:
                raise PipelineUsageError(
                    f"`{self.hook}` called the pipelined network more than once. A pipeline runs one forward pass"
                    " per microbatch: call the network once per step and derive everything from that output."
                )
            self._used = True
            return self._output
        if called_from_model_summary():
            # Lightning's ModelSummary runs `example_input_array` through the model on rank 0 only; no rank holds the
            # whole network, so the summary goes without input/output sizes instead of failing.
            return None
        raise PipelineUsageError(
            f"The pipelined network ({type(self.module).__name__}) was called outside a training, validation, test"
            " or predict step. Under PipelineParallelStrategy each rank holds only its stages, so the network can"
            " only run through the strategy's steps."
        )

    def capture(self, step: Callable[[], Any]) -> Call:
        """Run ``step`` until it calls the network and return that call."""
        self._mode, self._captured = "capture", None
        try:
            step()
        except _InputsCaptured:
            pass
        finally:
            self._mode = "off"
        if self._captured is None:
            raise PipelineUsageError(
                f"`{self.hook}` returned without calling the pipelined network, so the pipeline has no input."
                " Call the network (e.g. `self(x)` or `self.model(x)`) exactly once in each step."
            )
        return self._captured

    @contextmanager
    def responding(self, output: Any) -> Iterator[None]:
        """Within the block, the network's single call returns ``output``."""
        self._mode, self._output, self._used = "respond", output, False
        try:
            yield
        finally:
            self._mode, self._output = "off", None
        if not self._used:
            raise PipelineUsageError(
                f"`{self.hook}` did not call the pipelined network for this microbatch. Call the network"
                " (e.g. `self(x)`) exactly once in each step."
            )


def _class_forward(module: nn.Module) -> Callable[..., Any]:
    """``module``'s own forward, bound (what an intercepted network's copy calls)."""
    return type(module).forward.__get__(module)


@dataclass
class LoggedValue:
    """One ``self.log`` call recorded during a microbatch."""

    name: str
    value: Any
    kwargs: dict[str, Any] = field(default_factory=dict)


@contextmanager
def recording_logs(module: Any, sink: list[LoggedValue]) -> Iterator[None]:
    """Record ``module.log``/``module.log_dict`` calls into ``sink`` instead of logging them."""

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise PipelineUsageError(
                f"Pass `self.log({name!r}, ...)` options by keyword under PipelineParallelStrategy"
                " (e.g. `prog_bar=True`), so they can be replayed on every rank."
            )
        sink.append(LoggedValue(name, value, kwargs))

    def log_dict(dictionary: Any, *args: Any, **kwargs: Any) -> None:
        if is_metric_container(dictionary):
            # A MetricCollection: Lightning logs its members under their prefixed/postfixed names.
            items = dictionary.items(keep_base=False, copy_state=False)
        else:
            items = dict(dictionary).items()
        for key, value in items:
            log(key, value, *args, **kwargs)

    # Instance attributes shadow the methods; set in the instance dict directly (nn.Module.__setattr__ and
    # __delattr__ would search parameters, buffers and submodules on every microbatch).
    attributes = vars(module)
    attributes["log"], attributes["log_dict"] = log, log_dict
    try:
        yield
    finally:
        del attributes["log"], attributes["log_dict"]
