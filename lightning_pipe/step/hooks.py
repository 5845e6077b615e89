"""The strategy's gradient hooks: what Lightning's ``backward``, ``optimizer_step`` and ``block_backward_sync`` do under
a pipeline, on each rank.

:class:`GradientHooks` is a mixin of ``PipelineParallelStrategy``. The schedule computes a step's gradients inside
``training_step``; they are held (:class:`~lightning_pipe.parallel.grads.StageGradients`) and land in ``backward``,
after Lightning's ``zero_grad``; they are synchronised (replicas averaged, tied copies summed) once per optimizer step,
before Lightning clips them and steps. Under manual optimization ``manual_backward`` records its microbatch's loss while
the step runs (:mod:`lightning_pipe.step.manual`), and the synchronisation waits for the first clip or step that reads
the gradients.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

from torch import Tensor
from typing_extensions import override

from lightning_pipe.measure.memory import MemoryReport, SavedBytesRecorder, state_bytes
from lightning_pipe.measure.memory import tensor_parallel_share as tp_share
from lightning_pipe.step.manual import ManualOptimization

# A child of Lightning's logger: its lines appear wherever Lightning's own INFO lines do.
log = logging.getLogger("lightning.pytorch.lightning_pipe")


class GradientHooks:
    """Lightning's gradient hooks for ``PipelineParallelStrategy`` (it sets the attributes below in setup and
    ``training_step``), and the memory report logged after the first optimizer step."""

    #: the strategy's :class:`~lightning_pipe.session.PipelineSession`
    _session: Any
    _manual: Optional[ManualOptimization]
    #: the bytes each local stage saves for backward per microbatch (recorded on the first training forward)
    _saved: dict[int, SavedBytesRecorder]
    _memory_logged: bool

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The schedule already ran backward in ``training_step``; here its gradients land after Lightning's
        ``zero_grad``, exactly where a single-device backward would put them. (Manual optimization: while the step
        runs, ``manual_backward`` only records its microbatch's loss for the schedule.)"""
        if self._manual is not None and self._manual.recording:
            return self._manual.backward(closure_loss, args, kwargs)
        strategy: Any = self
        strategy.pre_backward(closure_loss)
        closure_loss = strategy.precision_plugin.pre_backward(closure_loss, strategy.lightning_module)
        self._session.gradients.stash.apply()
        closure_loss = strategy.precision_plugin.post_backward(closure_loss, strategy.lightning_module)
        strategy.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Synchronise gradients once per optimizer step: after the closure (the accumulation window's last
        ``training_step`` and ``backward``), before Lightning clips them and steps."""

        def closure_then_sync() -> Any:
            result = closure()
            # Manual optimization: once per backward since this optimizer's last synchronisation (a clip may have
            # come first)
            if self._manual is None or self._manual.take_unsynchronized(optimizer):
                self._session.gradients.synchronize(optimizer)
            return result

        stepped = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)  # type: ignore[misc]
        if not self._memory_logged:
            # After the first step: optimizers such as Adam create their state then.
            self._memory_logged = True
            for line in self.memory_report.lines():
                log.info(line)
        return stepped

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning runs the batches of an accumulation window before its last inside this: FSDP stages then keep
        their gradients unsynchronised (``"ddp"`` synchronises in ``optimizer_step`` only anyway)."""
        engine = self._session.engine
        with engine.unsynchronized() if engine is not None else nullcontext():
            yield

    @property
    def memory_report(self) -> MemoryReport:
        """What this rank holds: parameter, gradient and optimizer-state bytes now, bytes saved for backward per
        microbatch by each local stage (measured on the first training forward), and the peak allocated while its
        stages were built (``configure_model`` construction) and while ``init_weights`` was loaded. Logged once, after
        the first optimizer step."""
        strategy: Any = self
        split = self._session.split
        assert split is not None
        return MemoryReport(
            rank=strategy.global_rank,
            stages=tuple(split.bodies),
            state=state_bytes(strategy.model, strategy.optimizers),
            saved_per_microbatch={s: r.bytes for s, r in self._saved.items() if r.bytes is not None},
            construction_peak=split.construction_peak,
            tensor_parallel=tp_share(strategy.model, strategy.tensor_parallel_rank, strategy.tensor_parallel_size),
            load_peak=self._session.load_peak,
        )
