"""The schedules by name, and ``schedule=`` resolved: a torch schedule's canonical name or a
:class:`~lightning_pipe.schedules.custom.CustomSchedule` (a CSV path or lists of actions)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Union, get_args

from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.schedules.custom import CustomSchedule, load_schedule

ScheduleName = Literal[
    "auto", "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
]
#: Every schedule torch ships, by its canonical name (the names of :data:`ScheduleName` but ``"auto"``).
SCHEDULES: tuple[str, ...] = get_args(ScheduleName)[1:]
#: Schedules that drive exactly one stage per rank.
SINGLE_STAGE: frozenset[str] = frozenset({"GPipe", "1F1B"})
#: Schedules that place two stages per rank in a V: stage s and stage 2*P-1-s share a rank, so the last stage is on
#: pipeline rank 0.
V_SHAPED: frozenset[str] = frozenset({"ZBVZeroBubble", "DualPipeV"})
#: Schedules that split each backward into an input-gradient and a weight-gradient action (zero bubble). torch 2.13
#: refuses compiled stages under them (docs/compile.md says why).
SPLIT_BACKWARD: frozenset[str] = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"})
#: ``schedule=`` once normalised: a canonical name, or a schedule of one's own
Schedule = Union[str, CustomSchedule]


def canonical_schedule(name: str) -> str:
    """Map a schedule name, in any letter case, to its canonical spelling (``"auto"`` stays ``"auto"``)."""
    lookup = {s.lower(): s for s in (*SCHEDULES, "auto")}
    try:
        return lookup[str(name).lower()]
    except KeyError:
        raise PipelineConfigError(
            f"Unknown `schedule={name!r}`. Choose one of {', '.join(SCHEDULES)} or 'auto', or give the path to a CSV"
            " file of per-rank actions (docs/custom-schedules.md)."
        ) from None


def normal_schedule(schedule: Any) -> Schedule:
    """``schedule=`` normalised: a name to its canonical spelling; a CSV path (a ``.csv`` name or an existing file) or
    lists of action strings to a checked :class:`CustomSchedule`."""
    if isinstance(schedule, CustomSchedule):
        return schedule
    if isinstance(schedule, (str, os.PathLike)):
        path = Path(schedule)
        if isinstance(schedule, str) and path.suffix.lower() != ".csv" and not path.is_file():
            return canonical_schedule(schedule)
    return load_schedule(schedule)


def splits_backward(schedule: Schedule) -> bool:
    """Whether ``schedule`` (normalised) splits a backward into input-gradient and weight-gradient actions."""
    if isinstance(schedule, CustomSchedule):
        return schedule.split_backward
    return schedule in SPLIT_BACKWARD


def placement(schedule: Schedule) -> str:
    """How ``schedule`` (normalised, resolved) sets its stages on the ranks: ``"v"`` (there and back) or ``"loop"``."""
    if isinstance(schedule, CustomSchedule):
        return schedule.placement
    return "v" if schedule in V_SHAPED else "loop"


def schedule_argument(schedule: Schedule) -> Union[str, list[list[str]]]:
    """What ``schedule=`` takes to give ``schedule`` (normalised) again: its name, the CSV path it was read from, or
    its actions as lists (a LightningCLI config holds any of them)."""
    return schedule.argument if isinstance(schedule, CustomSchedule) else schedule


def check_custom_counts(schedule: CustomSchedule, pipeline_size: Any, microbatches: Any, microbatch_size: Any) -> None:
    """A schedule of one's own decides the pipeline size and the microbatch count: the arguments agree or are left
    ``"auto"``."""
    for name, value, own in (
        ("pipeline_size", pipeline_size, schedule.pipeline_size),
        ("microbatches", microbatches, schedule.microbatches),
    ):
        if value != "auto" and value != own:
            raise PipelineConfigError(
                f"The {schedule} runs {schedule.pipeline_size} rank(s) and {schedule.microbatches} microbatch(es), but"
                f" `{name}={value!r}`. Leave `{name}` at 'auto' (the schedule decides it) or set it to {own}."
            )
    if microbatch_size is not None:
        raise PipelineConfigError(
            f"The {schedule} runs {schedule.microbatches} microbatch(es) per batch, so `microbatch_size` cannot be"
            " set: leave it None and choose a batch size that is a multiple of the microbatches."
        )


def resolve_schedule(schedule: Schedule, stages_per_rank: Union[int, str]) -> tuple[Schedule, int]:
    """Resolve ``schedule`` (normalised) and ``stages_per_rank`` together.

    ``schedule="auto"`` is ``"1F1B"`` with one stage per rank and ``"Interleaved1F1B"`` with more.
    ``stages_per_rank="auto"`` is 1 for GPipe/1F1B, 2 for every multi-stage schedule, and what a schedule of one's
    own places.
    """
    valid = isinstance(stages_per_rank, int) and not isinstance(stages_per_rank, bool) and stages_per_rank >= 1
    if stages_per_rank != "auto" and not valid:
        raise PipelineConfigError(f"`stages_per_rank` must be 'auto' or an int >= 1, got {stages_per_rank!r}.")
    if isinstance(schedule, CustomSchedule):
        if stages_per_rank not in ("auto", schedule.stages_per_rank):
            raise PipelineConfigError(
                f"The {schedule} places {schedule.num_stages} stages on {schedule.pipeline_size} rank(s),"
                f" {schedule.stages_per_rank} per rank, but `stages_per_rank={stages_per_rank}`. Leave"
                " `stages_per_rank` at 'auto' or make them agree."
            )
        return schedule, schedule.stages_per_rank
    name = canonical_schedule(schedule)
    if name == "auto":
        spr = 1 if stages_per_rank == "auto" else int(stages_per_rank)
        return ("1F1B" if spr == 1 else "Interleaved1F1B"), spr
    if stages_per_rank == "auto":
        return name, 1 if name in SINGLE_STAGE else 2
    if name in SINGLE_STAGE and stages_per_rank != 1:
        raise PipelineConfigError(
            f"`schedule={name!r}` runs one stage per rank but `stages_per_rank={stages_per_rank}`. Use"
            " `stages_per_rank=1`, or a multi-stage schedule such as 'Interleaved1F1B'."
        )
    if name in V_SHAPED and stages_per_rank != 2:
        raise PipelineConfigError(
            f"`schedule={name!r}` places exactly two stages per rank (V shape) but `stages_per_rank={stages_per_rank}`."
            " Use `stages_per_rank=2` or 'auto'."
        )
    return name, int(stages_per_rank)
