"""Training: one ``torch.distributed.pipelining`` schedule step per batch."""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any, Union

import torch

from lightning_pipe.comm.dtensor import local
from lightning_pipe.compat import torch as torch_compat
from lightning_pipe.errors import MicrobatchError, PipelineConfigError
from lightning_pipe.microbatch import training_microbatches
from lightning_pipe.schedules.custom import CustomSchedule
from lightning_pipe.settings import SINGLE_STAGE, PipelineSettings
from lightning_pipe.step.runtime import PipelineRuntime
from lightning_pipe.step.stage import StepContext, chunk_aware_stage_class, watch

_MAX_CACHED_SCHEDULES = 8


def _zero_loss(output: Any) -> torch.Tensor:
    # torch infers backward shapes by back-propagating one loss through the first microbatch; any scalar that depends
    # on the output gives the same shapes, and a constant zero keeps the user's step (and its side effects) out of it.
    leaves = [output] if isinstance(output, torch.Tensor) else [t for t in output if isinstance(t, torch.Tensor)]
    # A DTensor output (a vocabulary-sharded head) contributes through its local part: a plain scalar either way.
    return sum((local(t).float().sum() * 0.0 for t in leaves if t.is_floating_point()), torch.zeros(()))


def _microbatch_index(target: torch.Tensor, arange: torch.Tensor | None) -> int:
    """The microbatch a schedule target (a one-element chunk of ``arange``, the step's ``torch.arange(n)``) stands
    for: the view's offset in it (metadata, so the step reads no tensor to the host), or the value where torch handed
    over a copy instead of a view."""
    if arange is not None and torch_compat.view_base(target) is arange and target.numel() == 1:  # torch's split
        return target.storage_offset()
    return int(target)


def step_options(schedule: Any) -> dict[str, Any]:
    """Keyword arguments for ``schedule.step``: the last stage's outputs are not kept nor merged (each microbatch's
    output already reached the user's step through the loss function), where this torch has ``return_outputs``."""
    return {"return_outputs": False} if torch_compat.step_options(schedule)["return_outputs"] else {}


@functools.lru_cache(maxsize=512)
def schedule_accepts(schedule: str, pipeline_size: int, stages_per_rank: int, microbatches: int) -> bool:
    """Whether torch's ``schedule`` runs ``microbatches`` microbatches on these stages (its own checks, on mock
    stages: 1F1B needs as many microbatches as stages, DualPipeV twice the ranks, Interleaved1F1B whole rounds)."""
    try:
        torch_compat.schedule_actions(schedule, pipeline_size, microbatches, stages_per_rank)
    except ValueError:
        return False
    return True


#: where a schedule accepts no count of equal microbatches that divides a batch (1F1B: fewer microbatches than
#: stages, DualPipeV: fewer than twice the ranks), the schedule on the same stages that runs that batch: GPipe runs
#: any count on 1F1B's stages, ZBVZeroBubble any count on DualPipeV's V placement. Each microbatch's forward and
#: backward are the same; only their order differs, so the batch trains exactly as on one device.
FALLBACK_SCHEDULES = {"1F1B": "GPipe", "DualPipeV": "ZBVZeroBubble"}


def microbatch_plan(settings: PipelineSettings, size: int) -> tuple[int, Union[str, CustomSchedule]]:
    """How many equal microbatches a training batch of ``size`` samples runs as under ``settings`` (resolved), and
    the schedule that runs them: the configured one, or (a batch it cannot run, such as a last batch of one sample
    under 1F1B) its :data:`FALLBACK_SCHEDULES` entry. A schedule of one's own runs its own count, or refuses."""
    s = settings
    if isinstance(s.schedule, CustomSchedule):
        return custom_microbatches(s.schedule, size), s.schedule

    def count(schedule: str) -> int:
        accepts = functools.partial(schedule_accepts, schedule, s.pipeline_size, s.stages_per_rank)
        return training_microbatches(size, s.microbatches, s.microbatch_size, s.num_stages, accepts, schedule)

    other = FALLBACK_SCHEDULES.get(s.schedule)
    try:
        n = count(s.schedule)
    except MicrobatchError:
        if other is None:
            raise
        return count(other), other
    # `microbatches="auto"` on a batch smaller than the stages gives one sample each, a count the user did not choose
    # (a count they chose is kept, and torch's refusal names it)
    auto = s.microbatches == "auto" and s.microbatch_size is None
    if auto and other is not None and not schedule_accepts(s.schedule, s.pipeline_size, s.stages_per_rank, n):
        return count(other), other
    return n, s.schedule


def custom_microbatches(schedule: CustomSchedule, size: int) -> int:
    """A schedule of one's own runs its microbatch count, whatever the batch: one it does not divide is refused."""
    if size % schedule.microbatches:
        raise MicrobatchError(
            f"A batch of {size} samples does not split into the {schedule.microbatches} equal microbatches of the"
            f" {schedule}. Use a batch size that is a multiple of {schedule.microbatches}, or `drop_last=True` in the"
            " DataLoader if only the last batch is short."
        )
    return schedule.microbatches


def microbatch_count(settings: PipelineSettings, size: int) -> int:
    """How many equal microbatches a training batch of ``size`` samples runs as under ``settings`` (resolved)."""
    return microbatch_plan(settings, size)[0]


class ScheduleExecutor:
    """Runs a batch's microbatches through a torch schedule; gradients accumulate into the stages' ``.grad``.

    Schedules are cached per microbatch count and call signature: torch infers stage shapes once per schedule, so a
    batch of another shape (a short last batch, a longer sequence) gets a schedule of its own.

    Every rank without the last stage receives a gradient from another rank during the schedule (its highest stage's
    successor is elsewhere) and waits for it: the stages call the step's ``on_receive`` as they post a receive.
    """

    #: the stages call ``StepContext.on_receive`` as they post a receive (:class:`~.base.Executor`)
    reports_receives = True

    def __init__(self, runtime: PipelineRuntime, settings: PipelineSettings) -> None:
        self.runtime = runtime
        self.settings = settings
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()
        #: the step being run, for the schedule's loss function (torch 2.11 and 2.12 have no ``loss_kwargs``)
        self._step: StepContext | None = None
        #: microbatch counts that the configured schedule does not run, planned under its fallback
        self._fallback: set[int] = set()
        #: the microbatch sizes of each batch size seen, and the schedule targets of each count (made once, not at
        #: every step; torch only splits the target into views and reads them)
        self._plans: dict[int, list[int]] = {}
        self._targets: dict[int, torch.Tensor] = {}

    def plan(self, size: int) -> list[int]:
        """Equal microbatch sizes for a batch of ``size`` samples (torch's schedules need equal shapes); a batch the
        configured count does not divide runs as another count, under another schedule where the configured one
        runs none (:func:`microbatch_plan`)."""
        if size not in self._plans:
            n, name = microbatch_plan(self.settings, size)
            if name != self.settings.schedule:
                self._fallback.add(n)
            self._plans[size] = [size // n] * n
        return list(self._plans[size])

    def run(self, key: tuple, step: StepContext) -> None:
        n = len(step.calls)
        schedule, options, torch_stages = self._schedule(key, n)
        # Every stage's forward reads the step from its module (a keyword of `schedule.step` would be copied per
        # microbatch by torch: lightning_pipe/step/stage.py); the loss function reads it from here.
        self._step = step
        stages = self.runtime.stages.values()
        for module in stages:
            module.step, module.on_receive = step, step.on_receive
        for stage in torch_stages:
            watch(stage)
        try:
            if self.runtime.has_last:
                # The target only carries the microbatch index (kept on the CPU: reading it never waits for a GPU).
                if n not in self._targets:
                    self._targets[n] = torch.arange(n)
                schedule.step(target=self._targets[n], **options)
            else:
                schedule.step(**options)
        except Exception as err:
            # torch wraps an error of a stage's forward in its own RuntimeError; the stage's error is the one to see.
            if step.failure is not None and step.failure is not err:
                raise step.failure from None
            raise
        finally:
            self._step = None
            for module in stages:
                module.step = module.on_receive = None

    def _schedule(self, key: tuple, n: int) -> tuple[Any, dict[str, Any], list[Any]]:
        """The schedule for ``key``, the options of its ``step`` and its stages (torch's, this rank's)."""
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        from torch.distributed.pipelining.schedules import get_schedule_class

        stage_cls = chunk_aware_stage_class()
        runtime = self.runtime
        mesh = {"get_mesh": self._mesh} if torch_compat.stage_takes_mesh() else {}
        stages = [
            stage_cls(module, index, runtime.num_stages, runtime.device, group=runtime.group, **mesh)
            for index, module in runtime.stages.items()
        ]
        name = self.settings.schedule
        if isinstance(name, CustomSchedule):
            schedule = torch_compat.custom_schedule(stages, n, self._loss, name.texts())
            return self._keep(key, schedule, stages)
        if n in self._fallback:
            name = FALLBACK_SCHEDULES[name]
        cls = get_schedule_class(name)
        try:
            if name in SINGLE_STAGE:
                schedule = cls(stages[0], n, loss_fn=self._loss, scale_grads=False)
            else:
                schedule = cls(stages, n, loss_fn=self._loss, scale_grads=False)
        except ValueError as err:
            gpipe = " or use `schedule='GPipe'`, which runs any number of microbatches" if name != "GPipe" else ""
            raise PipelineConfigError(
                f"torch's {name} schedule rejects {n} microbatches for {runtime.num_stages}"
                f" stages: {err}. Change `microbatches` (or the batch size) to satisfy it{gpipe}."
            ) from err
        return self._keep(key, schedule, stages)

    def _keep(self, key: tuple, schedule: Any, stages: list[Any]) -> tuple[Any, dict[str, Any], list[Any]]:
        """Cache ``schedule`` (on ``stages``) for ``key`` (the least recently used one goes beyond the cache's
        size)."""
        self._schedules[key] = (schedule, step_options(schedule), stages)
        if len(self._schedules) > _MAX_CACHED_SCHEDULES:
            self._schedules.popitem(last=False)
        return self._schedules[key]

    def _mesh(self, axes: tuple[str, ...], layout: Any) -> Any:
        """torch's ``get_mesh`` callback: the mesh on which a DTensor activation received from another stage is
        rebuilt (the sender's axes name it; every rank's mesh is the same, so ``layout`` adds nothing)."""
        return self.runtime.mesh_of(axes)

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the microbatch's output goes to the user's step (``step.on_output``), whose
        loss the schedule back-propagates. ``target`` carries the microbatch index."""
        step = self._step
        assert step is not None, "the loss function runs inside a schedule step"
        if step.inference_output:
            # torch's backward shape inference, right after its forward shape inference (not a real microbatch).
            step.inference_output = False
            return _zero_loss(output)
        assert step.on_output is not None, "the last stage's step has an output handler"
        microbatch = _microbatch_index(target, self._targets.get(len(step.calls)))
        last = self.runtime.stages[self.runtime.num_stages - 1]
        recorder = last.recorder
        if recorder is None:
            return step.on_output(microbatch, step.final_output(microbatch, output))
        start = recorder.now()
        loss = step.on_output(microbatch, step.final_output(microbatch, output))
        recorder.compute("L", last.index, microbatch, start)
        return loss
