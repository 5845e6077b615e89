"""Write the actions of a built-in schedule to a CSV: a starting point to edit into a schedule of one's own."""

from __future__ import annotations

import csv
import os
from typing import Union

from lightning_pipe.compat import torch as torch_compat
from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.schedules.custom import Action, CustomSchedule, checked
from lightning_pipe.schedules.names import SINGLE_STAGE, canonical_schedule, resolve_schedule


def builtin_schedule(schedule: str, pipeline_size: int, microbatches: int, stages_per_rank: int) -> CustomSchedule:
    """The actions torch's ``schedule`` (a canonical name) runs on ``pipeline_size`` ranks, checked."""
    try:
        cells = torch_compat.schedule_cells(schedule, pipeline_size, microbatches, stages_per_rank)
    except ValueError as err:
        raise PipelineConfigError(
            f"torch's {schedule} schedule does not run {microbatches} microbatches on {pipeline_size} ranks with"
            f" {stages_per_rank} stage(s) each: {err}"
        ) from None
    if schedule in SINGLE_STAGE:
        cells = [single_stage_order(schedule, stage, pipeline_size, microbatches) for stage in range(pipeline_size)]
    rows = tuple(tuple(tuple(Action(*a) for a in cell) for cell in row) for row in cells)
    return checked(CustomSchedule(rows, f"exported from {schedule}"))


def single_stage_order(schedule: str, stage: int, num_stages: int, microbatches: int) -> list[list[tuple]]:
    """The cells torch's GPipe or 1F1B runs on ``stage``, as its ``_step_microbatches`` runs them (torch 2.13's
    ``Schedule1F1B._get_pipeline_order``, drawn for its visualizer, numbers the later ranks' microbatches from 1):
    GPipe every forward then every backward; 1F1B ``num_stages - stage`` forwards, then one backward and one forward
    in turn, then the remaining backwards."""
    forwards = [[(stage, "F", m)] for m in range(microbatches)]
    backwards = [[(stage, "B", m)] for m in range(microbatches)]
    if schedule == "GPipe":
        return forwards + backwards
    warmup = min(microbatches, num_stages - stage)
    steady = [cell for m in range(microbatches - warmup) for cell in (backwards[m], forwards[warmup + m])]
    return forwards[:warmup] + steady + backwards[microbatches - warmup :]


def write_schedule(schedule: CustomSchedule, path: Union[str, os.PathLike]) -> None:
    """One row per pipeline rank, one cell per action, in torch's spelling (what ``schedule=path`` reads)."""
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(schedule.texts())


def export_schedule(
    schedule: str,
    pipeline_size: int,
    microbatches: int,
    path: Union[str, os.PathLike],
    stages_per_rank: Union[int, str] = "auto",
) -> CustomSchedule:
    """Write the actions of torch's ``schedule`` (any letter case; ``stages_per_rank="auto"`` as the strategy resolves
    it) to the CSV file ``path``, and return them."""
    name, spr = resolve_schedule(canonical_schedule(schedule), stages_per_rank)
    made = builtin_schedule(name, pipeline_size, microbatches, spr)
    write_schedule(made, path)
    return made
