"""Manual optimization (``self.automatic_optimization = False``) under the pipeline.

A manual-optimization ``training_step`` does its own optimizer work, e.g. Lightning's ``ManualOptimBoringModel``::

    opt = self.optimizers()
    loss = self.step(batch)
    opt.zero_grad()
    self.manual_backward(loss)
    opt.step()

Under the pipeline the schedule runs the forward and the backward, microbatch by microbatch, and the step protocol runs
the user's step once per microbatch: on every rank until the network call (to capture its inputs), and on the last
stage's rank to the end (to compute each microbatch's loss). So while those runs happen, what the step does with its
optimizers is *recorded*, not done (:meth:`ManualOptimization.recorded`):

- ``opt.zero_grad()`` and ``opt.step()``, on the LightningOptimizer ``self.optimizers()`` returns or on the optimizer
  itself;
- ``self.manual_backward(loss)``: ``loss`` is what the schedule back-propagates for that microbatch (divided by the
  microbatch count, which gives the gradient of the batch's mean loss, as for a returned loss);
- ``self.clip_gradients(opt, ...)``;
- ``sch.step()`` on a scheduler ``configure_optimizers`` returned (``self.lr_schedulers()``).

After the schedule, the last stage's record travels to every rank in the step's outcome, and every rank does those
calls once, in the order the step made them (:meth:`ManualOptimization.run`): ``manual_backward`` then adds the
schedule's gradients to ``.grad`` (Lightning's ``on_before_backward`` and ``on_after_backward`` see the batch's loss),
clipping uses the norm over every stage, and each ``step`` counts as Lightning's optimizer step. That is what one device
running the step on the whole batch does, so the patterns built on it (accumulating gradients over several batches
by stepping every k-th batch, clipping, a scheduler stepped per batch) come out as on one device.

Refused by name (:class:`~lightning_pipe.errors.PipelineUsageError`), because they cannot be made exact: a step that
calls ``manual_backward`` other than once (two losses back-propagated separately, as a GAN does: each would need
a schedule of its own); ``opt.step(closure)`` (the closure re-runs the forward, e.g. LBFGS); ``opt.step()`` before the
network's forward (the schedule ran the forward with the parameters before that step); a scheduler stepped with a
value (each microbatch would pass its own); and a step whose microbatches did different things.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_pipe.compat.lightning import lightning_optimizers
from lightning_pipe.errors import PipelineUsageError
from lightning_pipe.scope import replaced
from lightning_pipe.step.frontend import HookStep
from lightning_pipe.step.interception import InputsCaptured

#: one recorded call: (what, which optimizer or scheduler, its options)
Op = tuple[str, int, dict[str, Any]]

ZERO_GRAD, BACKWARD, CLIP, STEP, SCHEDULER = "zero_grad", "backward", "clip", "step", "scheduler"
_SAID = {
    ZERO_GRAD: "optimizer.zero_grad()",
    BACKWARD: "self.manual_backward(loss)",
    CLIP: "self.clip_gradients(...)",
    STEP: "optimizer.step()",
    SCHEDULER: "scheduler.step()",
}


@dataclass
class ManualResult:
    """What one run of a manual-optimization step gave the step protocol: the step's own return value, the calls it
    made, and the loss it passed to ``manual_backward`` (with its graph: the schedule back-propagates it)."""

    output: Any
    ops: tuple[Op, ...]
    loss: torch.Tensor


@dataclass
class _Book:
    ops: list[Op] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)


def describe(ops: tuple[Op, ...] | list[Op]) -> str:
    """The calls as the user wrote them, e.g. ``optimizer.zero_grad(), optimizer.step()``."""
    return ", ".join(_SAID[kind] for kind, _, _ in ops) or "nothing"


class ManualOptimization:
    """The optimizer calls of a manual-optimization ``training_step``: recorded while the step protocol runs it
    (:meth:`recorded`), done once per batch afterwards (:meth:`run`). ``module``: the LightningModule."""

    def __init__(self, module: Any, synchronize: Callable[[Any], None]) -> None:
        self.module = module
        #: ``synchronize(optimizer)``: its gradients averaged over data-parallel replicas, summed over tied copies
        self.synchronize = synchronize
        #: the optimizers (by index) whose gradients changed since they were last synchronised
        self._unsynchronized: set[int] = set()
        #: inside :meth:`recorded`: ``manual_backward`` records instead of adding gradients (the strategy asks)
        self.recording = False
        self._book: _Book | None = None

    @classmethod
    def of(
        cls, module: Any, previous: ManualOptimization | None, synchronize: Callable[[Any], None]
    ) -> ManualOptimization | None:
        """``module``'s (``previous`` if it is): ``None`` under automatic optimization."""
        if module.automatic_optimization:
            return None
        if previous is None or previous.module is not module:
            return cls(module, synchronize)
        previous.synchronize = synchronize  # this Trainer entry's gradients
        return previous

    def user_step(self, extra_args: tuple) -> ManualHookStep:
        """The module's ``training_step`` as the step protocol runs it (``extra_args``: after the batch)."""
        return ManualHookStep(self.module, "training_step", tuple(extra_args), self)

    # ------------------------------------------------------------------------------------------------ recording
    def _optimizers(self) -> list[tuple[Any, Any]]:
        """(the LightningOptimizer, the optimizer it wraps) per optimizer, in ``configure_optimizers``' order."""
        return [(wrapper, wrapper.optimizer) for wrapper in lightning_optimizers(self.module.trainer.strategy)]

    @contextmanager
    def recorded(self) -> Iterator[None]:
        """Inside the block (one step protocol run): the optimizers', schedulers' and clipping calls are recorded."""
        trainer = self.module.trainer
        with ExitStack() as stack:
            for index, (wrapper, optimizer) in enumerate(self._optimizers()):
                for target in (wrapper, optimizer):
                    stack.enter_context(replaced(target, "zero_grad", functools.partial(self._zero_grad, index)))
                    stack.enter_context(replaced(target, "step", functools.partial(self._step, index)))
            for index, config in enumerate(trainer.lr_scheduler_configs):
                stack.enter_context(replaced(config.scheduler, "step", functools.partial(self._scheduler, index)))
            stack.enter_context(replaced(trainer.precision_plugin, "clip_gradients", self._clip))
            self.recording = True
            stack.callback(setattr, self, "recording", False)
            yield

    def _record(self, kind: str, index: int, options: dict[str, Any]) -> None:
        assert self._book is not None, "recorded only inside a run of the user's step"
        self._book.ops.append((kind, index, options))

    def _zero_grad(self, index: int, set_to_none: bool = True) -> None:
        self._record(ZERO_GRAD, index, {"set_to_none": bool(set_to_none)})

    def _step(self, index: int, closure: Any = None, **kwargs: Any) -> None:
        if closure is not None:
            raise PipelineUsageError(
                "`optimizer.step(closure)` in a manual-optimization `training_step` is not supported by"
                " PipelineParallelStrategy: the closure re-runs the forward and backward (as LBFGS does), which the"
                " pipeline runs once per batch through its schedule. Call `self.manual_backward(loss)` once and then"
                " `optimizer.step()` without a closure, or train this module with `strategy='ddp'`."
            )
        self._record(STEP, index, dict(kwargs))

    def _scheduler(self, index: int, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            raise PipelineUsageError(
                f"`scheduler.step({_arguments(args, kwargs)})` inside a manual-optimization `training_step` is not"
                " supported by PipelineParallelStrategy: the step runs once per microbatch, so the value would be one"
                " microbatch's, not the batch's. Step the scheduler without arguments there, or with the value in"
                " `on_train_batch_end` or `on_train_epoch_end` (e.g. from `self.trainer.callback_metrics`)."
            )
        self._record(SCHEDULER, index, {})

    def _clip(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        from lightning.pytorch.utilities import GradClipAlgorithmType

        algorithm = GradClipAlgorithmType(gradient_clip_algorithm or GradClipAlgorithmType.NORM)
        self._record(CLIP, self._index_of(optimizer), {"clip_val": clip_val, "algorithm": algorithm.value})

    def _index_of(self, optimizer: Any) -> int:
        for index, (wrapper, raw) in enumerate(self._optimizers()):
            if optimizer is wrapper or optimizer is raw:
                return index
        raise PipelineUsageError(
            f"`self.clip_gradients` got an optimizer ({type(optimizer).__name__}) that `configure_optimizers` did not"
            " return. Pass the optimizer from `self.optimizers()`."
        )

    def backward(self, loss: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        """``self.manual_backward(loss, *args, **kwargs)`` while recording: ``loss`` is the microbatch's loss."""
        if args or kwargs:
            raise PipelineUsageError(
                f"`self.manual_backward(loss, {_arguments(args, kwargs)})`: PipelineParallelStrategy runs the backward"
                " through its schedule, which takes no options. Call `self.manual_backward(loss)`."
            )
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise PipelineUsageError(
                f"`self.manual_backward` got {shape}; under PipelineParallelStrategy it takes a scalar loss tensor"
                " (the schedule back-propagates one loss per microbatch)."
            )
        self._record(BACKWARD, 0, {})
        assert self._book is not None
        self._book.losses.append(loss)
        return loss

    # ------------------------------------------------------------------------------------------------ one run
    @contextmanager
    def _step_run(self) -> Iterator[_Book]:
        book = self._book = _Book()
        try:
            yield book
        finally:
            self._book = None

    def run_step(self, step: HookStep, microbatch: Any) -> ManualResult:
        """Run the user's step on one microbatch, recording its calls."""
        with self._step_run() as book:
            try:
                output = HookStep.__call__(step, microbatch)
            except InputsCaptured:  # capture stops the step at the network call: what came before ran before it
                if any(kind == STEP for kind, _, _ in book.ops):
                    raise PipelineUsageError(
                        "`training_step` called `optimizer.step()` before the pipelined network's forward. Under"
                        " PipelineParallelStrategy the schedule runs the forward of every microbatch with the"
                        " parameters as they are before the step's optimizer calls, so the updated parameters would"
                        " not be used as on one device. Step the optimizer after the forward (after"
                        " `self.manual_backward(loss)`)."
                    ) from None
                raise
        backwards = [op for op in book.ops if op[0] == BACKWARD]
        if len(backwards) != 1:
            raise PipelineUsageError(
                f"`training_step` called `self.manual_backward` {len(backwards)} times (its calls:"
                f" {describe(book.ops)}). Under PipelineParallelStrategy a manual-optimization step calls it exactly"
                " once: the schedule runs one backward per batch. Back-propagate the sum of the losses in one call;"
                " a step with two backward passes through different optimizers (a GAN) needs `strategy='ddp'`."
            )
        return ManualResult(output, tuple(book.ops), book.losses[0])

    # ------------------------------------------------------------------------------------------------ after
    def take_unsynchronized(self, optimizer: Any) -> bool:
        """Whether ``optimizer``'s gradients changed since their last synchronisation (once: it is synchronised now).

        Gradients are synchronised once before they are read (by a clip or a step), not per ``manual_backward``:
        tied copies are summed, which would count the gradients of earlier batches again when a step accumulates
        several batches."""
        index = self._index_of(optimizer)
        if index in self._unsynchronized:
            self._unsynchronized.discard(index)
            return True
        return False

    def run(self, outcome: Any) -> None:
        """Do the step's recorded calls (``outcome.manual_ops``, from the last stage) once, in order, on this rank;
        ``manual_backward`` gets the batch's loss (``outcome.loss``: the microbatches' mean)."""
        ops, loss = outcome.manual_ops, outcome.loss
        assert ops is not None and loss is not None, "a manual-optimization step's outcome"
        optimizers = self._optimizers()
        schedulers = self.module.trainer.lr_scheduler_configs
        for kind, index, options in ops:
            if kind == ZERO_GRAD:
                optimizers[index][0].zero_grad(**options)
            elif kind == BACKWARD:
                self.module.manual_backward(loss)
                self._unsynchronized = set(range(len(optimizers)))
            elif kind == CLIP:
                from lightning.pytorch.utilities import GradClipAlgorithmType

                if self.take_unsynchronized(optimizers[index][1]):  # clip the replicas' mean, as DDP's backward gives
                    self.synchronize(optimizers[index][1])
                algorithm = GradClipAlgorithmType(options["algorithm"])
                self.module.trainer.precision_plugin.clip_gradients(
                    optimizers[index][1], options["clip_val"], algorithm
                )
            elif kind == STEP:
                optimizers[index][0].step(**options)
            elif kind == SCHEDULER:
                schedulers[index].scheduler.step()


@dataclass
class ManualHookStep(HookStep):
    """``training_step`` of a manual-optimization LightningModule: each run returns a :class:`ManualResult`."""

    manual: ManualOptimization | None = None

    def __call__(self, microbatch: Any) -> Any:
        assert self.manual is not None
        return self.manual.run_step(self, microbatch)


def agreed_ops(name: str, per_microbatch: list[tuple[Op, ...]]) -> tuple[Op, ...]:
    """The step's calls, which every microbatch's run must have made alike."""
    first = per_microbatch[0]
    for m, ops in enumerate(per_microbatch[1:], start=1):
        if ops != first:
            raise PipelineUsageError(
                f"`{name}` made different optimizer calls for the microbatches of one batch (microbatch 0:"
                f" {describe(first)}; microbatch {m}: {describe(ops)}). The pipeline does a batch's calls once, after"
                " its schedule: make them depend on `batch_idx` or the step count, not on the data."
            )
    return first


def _arguments(args: tuple, kwargs: dict[str, Any]) -> str:
    return ", ".join([*(type(a).__name__ for a in args), *(f"{k}=..." for k in kwargs)])
