"""What the tuner may choose: the search space, the candidates in it, and which of them can run at all.

A :class:`Candidate` is one setting of the five strategy arguments the tuner decides (``schedule``,
``microbatches``, ``stages_per_rank``, ``activation_checkpointing``, ``compile``), and, when the space searches the
layout, of three more (``pipeline_size``, ``data_parallel``, ``tensor_parallel``:
:mod:`lightning_pipe.tune.layout`); every other argument stays the user's. :func:`candidates` lists the candidates
of a :class:`SearchSpace` that can run for a given pipeline size, batch size and block count: the microbatch count
divides the batch, every stage gets a block, the schedule takes that many stages per rank and microbatches (torch's
own schedule checks decide, through :func:`lightning_pipe.measure.simulate.schedule_orders`), ``compile`` is not
combined with a schedule that splits the backward, and one process per pipeline takes one stage. A schedule of one's
own (:class:`~lightning_pipe.schedules.custom.CustomSchedule`) fixes its pipeline size, stages per rank and
microbatch count: its candidates vary the rest.

Pure: no process group.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.measure.simulate import schedule_orders
from lightning_pipe.schedules.custom import CustomSchedule
from lightning_pipe.schedules.names import Schedule, normal_schedule, schedule_argument, splits_backward
from lightning_pipe.settings import SCHEDULES, SINGLE_STAGE, V_SHAPED


@functools.total_ordering
@dataclass(frozen=True)
class Candidate:
    """One setting of the tuned arguments (ordered: torch's schedules by name, then schedules of one's own)."""

    #: a canonical name, or a schedule of one's own
    schedule: Schedule
    microbatches: int
    stages_per_rank: int
    #: recompute every k-th block (0: none, 1: every block), as the strategy's ``activation_checkpointing``
    activation_checkpointing: int = 0
    compile: bool = False
    #: the layout (0 and ``""``: the strategy's own, not searched): processes per pipeline, how each stage is
    #: replicated over the pipelines (``"ddp"``/``"fsdp"``), processes sharing each stage
    pipeline_size: int = 0
    data_parallel: str = ""
    tensor_parallel: int = 0

    def __lt__(self, other: Candidate) -> bool:
        return self.order < other.order

    @property
    def order(self) -> tuple:
        """The fields in their order, the schedule as a name or ``(1, source)`` (names and schedules compare)."""
        fields = dataclasses.astuple(dataclasses.replace(self, schedule=""))
        return (_schedule_order(self.schedule), *fields[1:])

    def settings(self) -> dict[str, Any]:
        """The strategy arguments of this candidate (``compile``: ``True``/``False``; the layout's when searched; a
        schedule of one's own as the CSV path it was read from, else its actions as lists)."""
        out: dict[str, Any] = {
            "schedule": schedule_argument(self.schedule),
            "microbatches": self.microbatches,
            "microbatch_size": None,
            "stages_per_rank": self.stages_per_rank,
            "activation_checkpointing": self.activation_checkpointing,
            "compile": self.compile,
        }
        if self.pipeline_size:
            out.update(
                pipeline_size=self.pipeline_size, data_parallel=self.data_parallel, tensor_parallel=self.tensor_parallel
            )
        return out

    @property
    def label(self) -> str:
        text = f"{schedule_label(self.schedule)} M={self.microbatches} v={self.stages_per_rank}"
        if self.pipeline_size:
            text = f"{self.layout_label} | " + text
        every = self.activation_checkpointing
        if every:
            text += " +ckpt" if every == 1 else f" +ckpt/{every}"
        return text + (" +compile" if self.compile else "")

    @property
    def layout_label(self) -> str:
        """``pp=2 ddp tp=1`` (``no pipeline`` for one process per pipeline)."""
        head = "no pipeline" if self.pipeline_size == 1 else f"pp={self.pipeline_size}"
        return f"{head} {self.data_parallel} tp={self.tensor_parallel}"

    @property
    def eager(self) -> Candidate:
        """The same candidate without ``compile``."""
        return dataclasses.replace(self, compile=False)


def _schedule_order(schedule: Schedule) -> tuple:
    if isinstance(schedule, CustomSchedule):
        return (1, schedule.source)
    return (0, schedule)


def schedule_label(schedule: Schedule) -> str:
    """A name, or a schedule of one's own by its CSV file's name (``custom`` when given as lists)."""
    if isinstance(schedule, CustomSchedule):
        return Path(schedule.path).name if schedule.path is not None else "custom"
    return schedule


@dataclass(frozen=True)
class SearchSpace:
    """The values the tuner tries (every combination that can run).

    Arguments:
        schedules: Schedules by name, and schedules of one's own: the path to a CSV of per-rank actions, or a
            :class:`~lightning_pipe.schedules.custom.CustomSchedule` (its pipeline size, stages per rank and
            microbatch count are its own: ``microbatches`` and ``stages_per_rank`` do not apply to it). Default: all
            seven of torch.
        microbatches: Microbatch counts. ``"auto"``: the divisors of the batch size from the pipeline size up to
            ``4 * pipeline_size * max(stages_per_rank)``.
        stages_per_rank: Stages per rank for the multi-stage schedules (the single-stage ones always use 1; the V
            schedules 2). Default ``(2,)``.
        activation_checkpointing: Default ``(False, True)``: no block recomputed, or every block (an int ``k``:
            every ``k``-th).
        compile: Default ``(False,)``; ``(False, True)`` also measures compiled blocks (each compiled trial pays the
            compilation, at least seconds per block kind).
        pipeline_sizes: The layout: processes per pipeline. ``None`` (default): the strategy's own; ``"auto"``: every
            divisor of the processes (per tensor-parallel group), 1 (no pipeline: plain data parallelism or FSDP)
            included.
        data_parallel: How stages are replicated over the pipelines: ``None`` (default): the strategy's own;
            e.g. ``("ddp", "fsdp")``.
        tensor_parallel: Processes sharing every stage: ``None`` (default): the strategy's own; e.g. ``(1, 2)``
            (sizes above 1 need a model with a tensor-parallel plan).
    """

    schedules: tuple[Union[str, os.PathLike, CustomSchedule], ...] = SCHEDULES
    microbatches: Union[Literal["auto"], tuple[int, ...]] = "auto"
    stages_per_rank: tuple[int, ...] = (2,)
    activation_checkpointing: tuple[Union[bool, int], ...] = (False, True)
    compile: tuple[bool, ...] = (False,)
    pipeline_sizes: Union[None, Literal["auto"], tuple[int, ...]] = None
    data_parallel: Optional[tuple[str, ...]] = None
    tensor_parallel: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        schedules = tuple(normal_schedule(s) for s in self.schedules)
        if not schedules or "auto" in schedules:
            raise PipelineConfigError(
                f"`SearchSpace(schedules={self.schedules!r})` must name at least one schedule, not 'auto'. Choose"
                f" among {', '.join(SCHEDULES)}, or give the path to a CSV of per-rank actions."
            )
        object.__setattr__(self, "schedules", tuple(dict.fromkeys(schedules)))
        if self.microbatches != "auto":
            _check_ints("microbatches", self.microbatches, 1)
            object.__setattr__(self, "microbatches", tuple(sorted(set(self.microbatches))))
        _check_ints("stages_per_rank", self.stages_per_rank, 2)
        object.__setattr__(self, "stages_per_rank", tuple(sorted(set(self.stages_per_rank))))
        every = self.activation_checkpointing
        if not every or not all(isinstance(v, int) and v >= 0 for v in every):
            raise PipelineConfigError(
                f"`SearchSpace(activation_checkpointing={every!r})` must be a non-empty tuple of bools or ints >= 0"
                " (k: every k-th block), e.g. (False, True)."
            )
        object.__setattr__(self, "activation_checkpointing", tuple(dict.fromkeys(int(v) for v in every)))
        if not self.compile or not all(isinstance(v, bool) for v in self.compile):
            raise PipelineConfigError(
                f"`SearchSpace(compile={self.compile!r})` must be a non-empty tuple of bools, e.g. (False, True)."
            )
        object.__setattr__(self, "compile", tuple(dict.fromkeys(self.compile)))
        if self.pipeline_sizes not in (None, "auto"):
            _check_ints("pipeline_sizes", self.pipeline_sizes, 1)
            object.__setattr__(self, "pipeline_sizes", tuple(sorted(set(self.pipeline_sizes))))  # type: ignore[arg-type]
        if self.tensor_parallel is not None:
            _check_ints("tensor_parallel", self.tensor_parallel, 1)
            object.__setattr__(self, "tensor_parallel", tuple(sorted(set(self.tensor_parallel))))
        if self.data_parallel is not None:
            modes = self.data_parallel
            if not isinstance(modes, (tuple, list)) or not modes or not all(m in ("ddp", "fsdp") for m in modes):
                raise PipelineConfigError(
                    f"`SearchSpace(data_parallel={modes!r})` must be a non-empty tuple of 'ddp' and 'fsdp', e.g."
                    " ('ddp', 'fsdp')."
                )
            object.__setattr__(self, "data_parallel", tuple(dict.fromkeys(modes)))

    @property
    def searches_layout(self) -> bool:
        """Whether the space varies the layout (pipeline, data-parallel and tensor-parallel sizes, sharding)."""
        return (self.pipeline_sizes, self.data_parallel, self.tensor_parallel) != (None, None, None)

    def microbatch_counts(self, pipeline_size: int, batch_size: int) -> tuple[int, ...]:
        """The microbatch counts to try for batches of ``batch_size`` samples per pipeline."""
        if self.microbatches != "auto":
            return tuple(m for m in self.microbatches if batch_size % m == 0)
        top = 4 * pipeline_size * max(self.stages_per_rank)
        return tuple(m for m in range(pipeline_size, min(batch_size, top) + 1) if batch_size % m == 0)

    def counts_to_profile(self, pipeline_size: int, batch_size: int) -> set[int]:
        """The microbatch counts of this space's candidates at ``pipeline_size``: the space's for the named schedules,
        each schedule of one's own its own."""
        named = any(isinstance(s, str) for s in self.schedules)
        out = set(self.microbatch_counts(pipeline_size, batch_size)) if named else set()
        return out | {m for s in self.schedules for m, _ in _custom_shape(s, pipeline_size, batch_size)}

    def as_dict(self) -> dict[str, Any]:
        return {
            "schedules": [_schedule_fact(s) for s in self.schedules],
            "microbatches": self.microbatches if self.microbatches == "auto" else list(self.microbatches),
            "stages_per_rank": list(self.stages_per_rank),
            "activation_checkpointing": list(self.activation_checkpointing),
            "compile": list(self.compile),
            **(
                {
                    "pipeline_sizes": self.pipeline_sizes
                    if self.pipeline_sizes in (None, "auto")
                    else list(self.pipeline_sizes),  # type: ignore[arg-type]
                    "data_parallel": None if self.data_parallel is None else list(self.data_parallel),
                    "tensor_parallel": None if self.tensor_parallel is None else list(self.tensor_parallel),
                }
                if self.searches_layout
                else {}
            ),
        }


def _schedule_fact(schedule: Schedule) -> Any:
    """A schedule as the fingerprint sees it: a name, or where a schedule of one's own came from and its actions (an
    edited CSV is another schedule)."""
    if isinstance(schedule, CustomSchedule):
        return {"schedule": schedule.path or schedule.source, "actions": schedule.texts()}
    return schedule


def _check_ints(name: str, values: Any, least: int) -> None:
    if (
        not isinstance(values, (tuple, list))
        or not values
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= least for v in values)
    ):
        raise PipelineConfigError(
            f"`SearchSpace({name}={values!r})` must be a non-empty tuple of ints >= {least}, e.g."
            f" ({least}, {2 * least})."
        )


def stage_counts(schedule: str, space: SearchSpace) -> tuple[int, ...]:
    """The stages per rank ``schedule`` (a name) can run with, of those in ``space``."""
    if schedule in SINGLE_STAGE:
        return (1,)
    if schedule in V_SHAPED:
        return (2,)
    return space.stages_per_rank


def runs(schedule: str, pipeline_size: int, microbatches: int, stages_per_rank: int) -> bool:
    """Whether torch's ``schedule`` takes this many ranks, microbatches and stages per rank."""
    try:
        schedule_orders(schedule, pipeline_size, microbatches, stages_per_rank)
    except ValueError:
        return False
    return True


def _custom_shape(schedule: Schedule, pipeline_size: int, batch_size: int) -> list[tuple[int, int]]:
    """A schedule of one's own's ``(microbatches, stages per rank)`` when it runs this pipeline size and batch."""
    if not isinstance(schedule, CustomSchedule) or schedule.pipeline_size != pipeline_size:
        return []
    if batch_size % schedule.microbatches:
        return []
    return [(schedule.microbatches, schedule.stages_per_rank)]


def shapes(
    schedule: Schedule, space: SearchSpace, pipeline_size: int, batch_size: int, num_blocks: int
) -> list[tuple[int, int]]:
    """The ``(microbatches, stages per rank)`` ``schedule`` runs at this pipeline size and batch, every stage with
    a block: a named schedule's from the space, fewer microbatches and stages first; a schedule of one's own its
    own."""
    if isinstance(schedule, CustomSchedule):
        found = _custom_shape(schedule, pipeline_size, batch_size)
    elif pipeline_size == 1 and schedule not in SINGLE_STAGE:
        found = []
    else:
        counts = space.microbatch_counts(pipeline_size, batch_size)
        found = [(m, spr) for m in counts for spr in stage_counts(schedule, space)]
    return [
        (m, spr)
        for m, spr in found
        if pipeline_size * spr <= num_blocks
        and (isinstance(schedule, CustomSchedule) or runs(schedule, pipeline_size, m, spr))
    ]


def candidates(
    space: SearchSpace, pipeline_size: int, batch_size: int, num_blocks: int, layout: Any = None
) -> list[Candidate]:
    """Every candidate of ``space`` that can run: ``batch_size`` samples per batch (per pipeline), ``num_blocks``
    blocks to share out (each stage needs one). In a fixed order (schedules as given, then fewer microbatches,
    fewer stages per rank, without checkpointing, without compile first). ``layout``: a
    :class:`~lightning_pipe.tune.layout.ProcessLayout` the candidates carry (its pipeline size replaces
    ``pipeline_size``; one process per pipeline takes only the single-stage schedules, one stage)."""
    if layout is not None:
        pipeline_size = layout.pipeline_size
    out = []
    for schedule in space.schedules:
        for microbatches, spr in shapes(schedule, space, pipeline_size, batch_size, num_blocks):
            for checkpointing in space.activation_checkpointing:
                for compiled in space.compile:
                    if compiled and splits_backward(schedule):
                        continue
                    found = Candidate(schedule, microbatches, spr, checkpointing, compiled)
                    out.append(found if layout is None else layout.carried_by(found))
    return out


def from_settings(settings: Any, microbatches: int) -> Candidate:
    """The candidate that resolved strategy settings (a :class:`~lightning_pipe.settings.PipelineSettings`) amount
    to, with the microbatch count the strategy resolved for the batches it saw."""
    return Candidate(
        settings.schedule,
        microbatches,
        int(settings.stages_per_rank),
        int(settings.activation_checkpointing),
        settings.compile is not None,
    )


def describe(found: Sequence[Candidate]) -> str:
    return ", ".join(c.label for c in found[:4]) + (f", ... ({len(found)} in all)" if len(found) > 4 else "")
