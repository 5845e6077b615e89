"""A Fabric loop's steps under a pipeline: ``loss = model.step(fn, batch)`` runs the schedule (forward and backward
together), ``fabric.backward(loss)`` then hands the step's gradients over, scaled as ``loss`` was, and
``model.evaluate(fn, batch)`` runs a forward-only pass. The Fabric strategy (``lightning_pipe/fabric.py``) adapts
Fabric's calls to these; the step itself is the engine's (:class:`~lightning_pipe.step.frontend.FunctionStep`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_pipe.compat import lightning as pl_compat
from lightning_pipe.errors import PipelineUsageError
from lightning_pipe.parallel import data_parallel as dp_modes
from lightning_pipe.step.frontend import FunctionStep

NOT_FROM_STEP = (
    "The tensor given to `fabric.backward` does not depend on the loss that `model.step(fn, batch)` returned. Pass"
    " that loss, or a tensor computed from it (e.g. `loss / accumulate`)."
)


@dataclass
class _PendingStep:
    """The loss of a step whose gradients wait for ``fabric.backward``."""

    loss: Tensor
    grad_scale: Optional[float]


class FabricSteps:
    """The steps of one set-up model. ``session`` is the strategy's :class:`~lightning_pipe.session.PipelineSession`
    (its engine, gradients, settings and wrappers), ``precision`` Fabric's precision plugin."""

    def __init__(self, session: Any, engine: Callable[[], Any], precision: Any, device: torch.device) -> None:
        self.session, self.engine, self.precision, self.device = session, engine, precision, device
        self._pending: Optional[_PendingStep] = None
        self._in_backward = False
        self._unsynchronized = False  # gradients handed over since the last synchronisation

    def step(self, fn: Callable[[Any], Any], batch: Any) -> Tensor:
        """One training step: ``fn(microbatch)`` (calls the model once, returns the loss or a dict with ``"loss"``
        and ``"num_items"``) runs per microbatch and the schedule runs forward and backward. Returns the batch's loss
        on every rank, as one device computes it; ``fabric.backward(loss)`` (or of any function of it) hands the
        gradients over."""
        if self._pending is not None:
            raise PipelineUsageError(
                "`model.step(fn, batch)` was called again before `fabric.backward(loss)` of the previous step. Under"
                " Fabric(strategy='pipeline') each step's backward has run already; `fabric.backward` adds its"
                " gradients (call it once per step, e.g. `fabric.backward(loss * 0)` to drop a step's gradients)."
            )
        engine, gradients = self.engine(), self.session.gradients
        user_step = FunctionStep(fn, context=self._outside_forward_context())
        with self.precision.forward_context(), gradients.capture(), pl_compat.inside_fabric_backward():
            outcome = engine.train(user_step, batch)
        window = None if engine.synchronized else "`fabric.no_backward_sync`"
        session = self.session
        dp_modes.check_token_weighting(
            session.settings, outcome.grad_scale, window=window, group_of=lambda: session.data_parallel_group
        )
        loss = outcome.loss.detach().clone().requires_grad_(True)
        loss.register_hook(self._outside_backward)
        self._pending = _PendingStep(loss, outcome.grad_scale)
        return loss

    def evaluate(self, fn: Callable[[Any], Any], batch: Any) -> Any:
        """``fn(microbatch)`` (calls the model once) over the batch's microbatches in a forward-only pass; returns
        what ``fn`` returned, merged over the microbatches as the Trainer merges ``validation_step`` outputs (on
        every rank where it holds only scalars, else on the last stage's rank)."""
        engine, context = self.engine(), self._outside_forward_context()
        user_step = FunctionStep(fn, name="the evaluation function", hook="validation_step", context=context)
        with torch.no_grad(), self.precision.forward_context():
            outcome = engine.evaluate(user_step, batch)
        if self.session.wrapped.sharded:
            dp_modes.reshard(engine.runtime.stages.values())
        return outcome.output

    def _outside_forward_context(self) -> Callable[[], AbstractContextManager[Any]]:
        """Where the step function runs: outside the precision's forward context (autocast, the default dtype of
        ``'bf16-true'``), as Fabric runs a loop's own code; the stages run inside it. The model's output reaches the
        function as Fabric's module wrapper converts it (to the default dtype outside the context)."""
        dtype, device_type = torch.get_default_dtype(), self.device.type

        @contextmanager
        def outside() -> Generator[None, None, None]:
            inside = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                with torch.autocast(device_type, enabled=False):
                    yield
            finally:
                torch.set_default_dtype(inside)

        return outside

    def _outside_backward(self, grad: Tensor) -> None:
        if not self._in_backward:
            raise PipelineUsageError(
                "`loss.backward()` was called on the loss of `model.step(fn, batch)`. Under Fabric(strategy='pipeline')"
                " the step ran its backward already; call `fabric.backward(loss)`, which hands its gradients over."
            )

    def backward(self, tensor: Tensor, run_backward: Callable[[], None]) -> None:
        """The pending step's gradients land in ``.grad``, multiplied by d ``tensor`` / d ``loss`` (``loss / 2`` for
        accumulation: halved), which is what back-propagating ``tensor`` on one device gives. ``run_backward()``
        back-propagates ``tensor`` as Fabric does."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise PipelineUsageError(
                "`fabric.backward(loss)` under Fabric(strategy='pipeline') takes the loss that `model.step(fn, batch)`"
                " returned (or a tensor computed from it), once per step; no step is waiting for it. Run the forward"
                " and the loss through `loss = model.step(fn, batch)` first."
            )
        if not tensor.requires_grad:
            raise PipelineUsageError(NOT_FROM_STEP)
        self._in_backward = True
        try:
            run_backward()
        finally:
            self._in_backward = False
        factor = pending.loss.grad
        if factor is None:
            raise PipelineUsageError(NOT_FROM_STEP)
        stash = self.session.gradients.stash
        stash.scale = float(factor) * (pending.grad_scale if pending.grad_scale is not None else 1.0)
        stash.apply()
        self._unsynchronized = True

    def synchronize(self) -> None:
        """Tied copies summed and replicas averaged, once for the gradients handed over since the last time: at the
        clip or the optimizer step, whichever comes first (as the Trainer's strategy does in ``optimizer_step``)."""
        if self._unsynchronized:
            gradients = self.session.gradients
            gradients.sync.synchronize(gradients.parameters())
            self._unsynchronized = False
