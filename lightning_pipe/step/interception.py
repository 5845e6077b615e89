"""How the user's unchanged steps run under a pipeline: the network call is intercepted, ``self.log`` recorded.

The pipelined network is never called as a whole. Its ``forward`` is replaced by a :class:`CallInterceptor`:

- in *capture* mode, the user's step runs until it calls the network; the interceptor records the call's arguments
  and stops the step (every rank does this for every microbatch: that call is the pipeline's input and the source of
  each stage's side inputs);
- in *respond* mode, on the rank holding the last stage, the user's step runs once per microbatch and the
  interceptor returns that microbatch's pipeline output, from which the step computes its loss and logs;
- in *lockstep* mode (a step that generates), every rank runs the user's step on the whole batch and each network
  call, those ``generate`` makes included, is one pass through the stages answered on every rank
  (:mod:`lightning_pipe.step.generation`).

A network with a ``generate`` method (transformers) gets a :class:`GenerateInterceptor` too: capturing a step stops at
``generate`` as at a forward, and the call is marked, so that the step protocol runs the step in lockstep.

``self.log`` calls made during those runs are recorded (:class:`RecordingLogs`); the step protocol merges them over
microbatches and replays them once, on every rank.
"""

from __future__ import annotations

import inspect
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
    #: the step's first use of the network was ``generate(...)``, not a forward
    generate: bool = False


class InputsCaptured(BaseException):
    """Ends the user's step at the network call (a BaseException, so ``except Exception`` cannot swallow it)."""


class CallInterceptor:
    """Stands in for the pipelined network's ``forward`` while the strategy runs a step."""

    def __init__(self, module: nn.Module, outside: str = "") -> None:
        self.module = module
        #: how messages name the step running now
        self.step_name = "training_step"
        #: what a call outside any step is told (default: the Trainer's steps)
        self.outside = outside or (
            f"The pipelined network ({type(module).__name__}) was called outside a training, validation, test"
            " or predict step. Under PipelineParallelStrategy each rank holds only its stages, so the network can"
            " only run through the strategy's steps."
        )
        self._mode = "off"
        self._output: Any = None
        self._used = False
        self._captured: Call | None = None
        #: whether the last :meth:`capture_each` captured a ``generate`` call (a step that generates)
        self.captured_generate = False
        #: in lockstep mode: ``answer(call) -> output``, the same on every rank
        self._answer: Callable[[Call], Any] | None = None
        # `generate` reads the forward's parameters (position_ids, logits_to_keep) to decide what to pass it.
        try:
            self.__signature__ = inspect.signature(module.forward)
        except (TypeError, ValueError):  # a forward without a signature (a builtin): (*args, **kwargs) as before
            pass
        # An instance attribute shadows the class's forward; nn.Module.__call__ looks it up on the instance.
        module.forward = self  # type: ignore[method-assign]
        self.generate = GenerateInterceptor(self) if callable(getattr(module, "generate", None)) else None

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)
        self.module.__dict__.pop("generate", None)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        # A pickled or deep-copied network (kept in `save_hyperparameters()`, copied by an EMA/SWA callback) gets its
        # class's forward back: the copy is not run by the strategy, and the interceptor's state is one step's.
        return _class_method, (self.module, "forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._mode == "capture":
            self._captured = Call(args, kwargs)
            raise InputsCaptured
        if self._mode == "lockstep":
            assert self._answer is not None
            return self._answer(Call(args, kwargs))
        if self._mode == "respond":
            if self._used:
                raise PipelineUsageError(
                    f"`{self.step_name}` called the pipelined network more than once. A pipeline runs one forward pass"
                    " per microbatch: call the network once per step and derive everything from that output. To"
                    " decode token by token, call a transformers model's `generate(...)` in validation, test or"
                    " predict steps."
                )
            self._used = True
            return self._output
        if called_from_model_summary():
            # Lightning's ModelSummary runs `example_input_array` through the model on rank 0 only; no rank holds the
            # whole network, so the summary goes without input/output sizes instead of failing.
            return None
        raise PipelineUsageError(self.outside)

    def capture(self, step: Callable[..., Any], *args: Any) -> Call:
        """Run ``step(*args)`` until it calls the network and return that call."""
        return self.capture_each(lambda _: step(*args), [None])[0]

    def capture_each(self, step: Callable[[Any], Any], inputs: list[Any]) -> list[Call]:
        """Run ``step(x)`` for each of ``inputs`` until it calls the network; those calls (one loop for a step's
        microbatches: this runs for every microbatch on every rank)."""
        calls = []
        self._mode, self.captured_generate = "capture", False
        try:
            for x in inputs:
                self._captured = None
                try:
                    step(x)
                except InputsCaptured:
                    pass
                if self._captured is None:
                    raise PipelineUsageError(
                        f"`{self.step_name}` returned without calling the pipelined network, so the pipeline has no"
                        " input. Call the network (e.g. `self(x)` or `self.model(x)`) exactly once in each step."
                    )
                calls.append(self._captured)
        finally:
            self._mode, self._captured = "off", None
        return calls

    def generate_called(self, args: tuple, kwargs: dict, run: Callable[[tuple, dict], Any] | None) -> Any:
        """The network's ``generate`` was called: captured, or run on this rank (lockstep), or refused."""
        if self._mode == "capture":
            self._captured, self.captured_generate = Call(args, kwargs, generate=True), True
            raise InputsCaptured
        if self._mode == "lockstep":
            assert run is not None
            return run(args, kwargs)
        if self._mode == "respond":
            raise PipelineUsageError(
                f"`{self.step_name}` called `generate` after calling the pipelined network. A step that generates runs"
                " on every stage, which the strategy learns from the step's first use of the network: call"
                " `generate(...)` before any other call of the network in the step."
            )
        raise PipelineUsageError(
            f"`generate` of the pipelined network ({type(self.module).__name__}) was called outside a validation,"
            " test or predict step. Under PipelineParallelStrategy each rank holds only its stages, so the network"
            " can only generate inside the strategy's steps."
        )

    @contextmanager
    def lockstep(self, answer: Callable[[Call], Any], generate: Callable[[tuple, dict], Any]) -> Iterator[None]:
        """Within the block, every call of the network is answered by ``answer`` and ``generate(...)`` runs
        ``generate(args, kwargs)``."""
        self._mode, self._answer = "lockstep", answer
        if self.generate is not None:
            self.generate.run = generate
        try:
            yield
        finally:
            self._mode, self._answer = "off", None
            if self.generate is not None:
                self.generate.run = None

    def responding(self, output: Any) -> CallInterceptor:
        """Within the block, the network's single call returns ``output``. (The block is the interceptor itself: no
        object is made for it, entered on every microbatch of the last stage.)"""
        self._mode, self._output, self._used = "respond", output, False
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if kind is None and self._used:  # the usual end of a :meth:`responding` block (what end_response does)
            self._mode, self._output = "off", None
        else:
            self.end_response(completed=kind is None)

    def end_response(self, completed: bool) -> None:
        """The block of :meth:`responding` ends (``completed``: without an exception)."""
        self._mode, self._output = "off", None
        if completed and not self._used:
            raise PipelineUsageError(
                f"`{self.step_name}` did not call the pipelined network for this microbatch. Call the network"
                " (e.g. `self(x)`) exactly once in each step."
            )


class GenerateInterceptor:
    """Stands in for the network's ``generate`` while the strategy runs a step (installed by
    :class:`CallInterceptor`, which it reports to)."""

    def __init__(self, forward: CallInterceptor) -> None:
        self.forward = forward
        #: in lockstep mode: ``run(args, kwargs) -> output`` runs the real ``generate`` on this rank
        self.run: Callable[[tuple, dict], Any] | None = None
        forward.module.generate = self  # type: ignore[method-assign]

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        # As the forward's interceptor: a pickled or copied network gets its class's generate back.
        return _class_method, (self.forward.module, "generate")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward.generate_called(args, kwargs, self.run)


def _class_method(module: nn.Module, name: str) -> Callable[..., Any]:
    """``module``'s own method ``name``, bound (what an intercepted network's copy calls)."""
    return getattr(type(module), name).__get__(module)


@dataclass
class LoggedValue:
    """One ``self.log`` call recorded during a microbatch."""

    name: str
    value: Any
    kwargs: dict[str, Any] = field(default_factory=dict)


class RecordingLogs:
    """Within the block, ``module.log``/``module.log_dict`` calls are recorded into ``sink`` instead of logged (a
    class, not a generator: entered twice per microbatch)."""

    __slots__ = ("attributes", "sink")

    def __init__(self, module: Any, sink: list[LoggedValue]) -> None:
        self.attributes, self.sink = module.__dict__, sink

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise PipelineUsageError(
                f"Pass `self.log({name!r}, ...)` options by keyword under PipelineParallelStrategy"
                " (e.g. `prog_bar=True`), so they can be replayed on every rank."
            )
        self.sink.append(LoggedValue(name, value, kwargs))

    def log_dict(self, dictionary: Any, *args: Any, **kwargs: Any) -> None:
        if is_metric_container(dictionary):
            # A MetricCollection: Lightning logs its members under their prefixed/postfixed names.
            items = dictionary.items(keep_base=False, copy_state=False)
        else:
            items = dict(dictionary).items()
        for key, value in items:
            self.log(key, value, *args, **kwargs)

    def __enter__(self) -> None:
        # Instance attributes shadow the methods; set in the instance dict directly (nn.Module.__setattr__ and
        # __delattr__ would search parameters, buffers and submodules on every microbatch).
        self.attributes["log"], self.attributes["log_dict"] = self.log, self.log_dict

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        del self.attributes["log"], self.attributes["log_dict"]
