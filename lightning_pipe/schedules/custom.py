"""A schedule of one's own: each pipeline rank's compute actions, read from torch's CSV format or given as lists, and
checked before any process group exists.

The format is the one torch's ``_PipelineScheduleRuntime`` loads (torchtitan's ``pipeline_parallel_schedule_csv``):
one row per pipeline rank, one cell per action, in the order the rank runs them. An action is the stage, the kind and
the microbatch: ``0F1`` (stage 0's forward of microbatch 1), ``1B0`` (full backward), ``1I0`` (input-gradient
backward) and ``1W0`` (weight-gradient backward, after its ``I``); two actions run back to back as one are written
``(0F1;3B0)OVERLAP_F_B`` (torch's spelling) or ``0F1;3B0``. torch adds the sends and receives.

Pure: no process group, no step. The stages' placement on the ranks, the number of stages and the number of
microbatches follow from the actions.
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional, Union

from lightning_pipe.errors import PipelineConfigError

#: torch's communication and resharding actions: it adds them itself to a compute-only schedule.
COMMUNICATION = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")
_ACTION = re.compile(r"(\d+)(F|B|I|W)(\d+)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
#: what a schedule given as lists may hold: per rank, a sequence of action strings
Rows = Sequence[Sequence[str]]


class Action(NamedTuple):
    """One compute action: ``kind`` is ``"F"``, ``"B"``, ``"I"`` or ``"W"``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


#: one cell of a row: a single action, or the actions of an overlapped cell (run one after the other)
Cell = tuple[Action, ...]


def cell_text(cell: Cell) -> str:
    """A cell in torch's spelling (what ``_Action.from_str`` reads)."""
    if len(cell) == 1:
        return str(cell[0])
    return f"({';'.join(map(str, cell))})OVERLAP_F_B"


def stage_to_rank(num_stages: int, pipeline_size: int, style: str) -> list[int]:
    """The pipeline rank that holds each stage: round robin (``"loop"``) or there and back (``"v"``)."""
    if style == "loop":
        return [s % pipeline_size for s in range(num_stages)]
    if style == "v":
        return [
            s % pipeline_size if (s // pipeline_size) % 2 == 0 else pipeline_size - 1 - s % pipeline_size
            for s in range(num_stages)
        ]
    raise ValueError(f"Unknown placement style {style!r}.")


class _Refusal(Exception):
    """A problem at one rank's action, made into a :class:`PipelineConfigError` naming the schedule's source."""

    def __init__(self, rank: int, action: str, reason: str) -> None:
        super().__init__(reason)
        self.rank, self.action, self.reason = rank, action, reason


def parse_cell(text: str, rank: int) -> Cell:
    """One CSV cell as its actions; an unknown or malformed action is refused with the reason."""
    text = text.strip()
    overlap = _OVERLAP.fullmatch(text)
    parts = (overlap.group(1) if overlap else text).split(";")
    if len(parts) > 2 or (overlap and len(parts) != 2):
        raise _Refusal(rank, text, "an overlapped cell holds exactly two actions, e.g. (0F1;3B0)OVERLAP_F_B")
    cell = []
    for part in (p.strip() for p in parts):
        match = _ACTION.fullmatch(part)
        if match is None:
            kind = part.lstrip("0123456789").rstrip("0123456789")
            if kind in COMMUNICATION:
                reason = (
                    f"{kind} is a communication action; give compute actions only (torch adds the sends and receives)"
                )
            else:
                reason = "not an action: write the stage, the kind (F, B, I or W) and the microbatch, e.g. 0F1"
            raise _Refusal(rank, text, reason)
        cell.append(Action(int(match.group(1)), match.group(2), int(match.group(3))))
    return tuple(cell)


@dataclass(frozen=True, repr=False)
class CustomSchedule:
    """A checked schedule of one's own: ``rows[r]`` holds pipeline rank ``r``'s cells, in the order it runs them."""

    rows: tuple[tuple[Cell, ...], ...]
    #: where it came from, for messages: a CSV path or ``"the given lists"``
    source: str
    #: the CSV file it was read from (``None``: given as lists, or exported)
    path: Optional[str] = None

    def __str__(self) -> str:
        return f"custom schedule {self.source}"

    def __repr__(self) -> str:
        return (
            f"CustomSchedule({self.source!r}: {self.pipeline_size} ranks, {self.num_stages} stages,"
            f" {self.microbatches} microbatches)"
        )

    @property
    def pipeline_size(self) -> int:
        return len(self.rows)

    @property
    def actions(self) -> list[list[Action]]:
        """Each rank's actions, an overlapped cell's one after the other."""
        return [[a for cell in row for a in cell] for row in self.rows]

    @property
    def num_stages(self) -> int:
        return 1 + max(a.stage for row in self.actions for a in row)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pipeline_size

    @property
    def microbatches(self) -> int:
        return 1 + max(a.microbatch for row in self.actions for a in row)

    @property
    def placement(self) -> str:
        """``"loop"`` or ``"v"``: how the stages sit on the ranks (checked when the schedule is made)."""
        ranks = self.stage_ranks()
        return "loop" if ranks == stage_to_rank(self.num_stages, self.pipeline_size, "loop") else "v"

    @property
    def split_backward(self) -> bool:
        """Whether a backward is split into input-gradient and weight-gradient actions."""
        return any(a.kind in "IW" for row in self.actions for a in row)

    def texts(self) -> list[list[str]]:
        """Each rank's cells in torch's spelling."""
        return [[cell_text(c) for c in row] for row in self.rows]

    @property
    def argument(self) -> Union[str, list[list[str]]]:
        """What ``schedule=`` takes to give this schedule again: the CSV path it was read from, else the lists."""
        return self.path if self.path is not None else self.texts()

    def stage_ranks(self) -> list[int]:
        """The pipeline rank that runs each stage."""
        held = {a.stage: rank for rank, row in enumerate(self.actions) for a in row}
        return [held[s] for s in range(self.num_stages)]


def load_schedule(schedule: Union[str, os.PathLike, Rows]) -> CustomSchedule:
    """A schedule from a CSV path (one row per rank) or lists of action strings, checked (:func:`check_schedule`)."""
    if isinstance(schedule, (str, os.PathLike)):
        path = Path(schedule)
        if not path.is_file():
            raise PipelineConfigError(
                f"`schedule={str(schedule)!r}` is neither a schedule name nor a CSV file of per-rank actions."
                " Give a torch schedule by name or the path to an existing CSV file (docs/custom-schedules.md)."
            )
        with path.open(newline="") as f:
            texts: Rows = [row for row in csv.reader(f) if any(cell.strip() for cell in row)]
        source = read_from = str(path)
    else:
        texts, source, read_from = schedule, "the given lists", None
        if isinstance(texts, str) or not all(
            isinstance(r, Sequence) and not isinstance(r, str) and all(isinstance(c, str) for c in r) for r in texts
        ):
            raise PipelineConfigError(
                f"A schedule given as lists needs one list of action strings per rank, got {schedule!r}."
            )
    try:
        rows = tuple(tuple(parse_cell(t, rank) for t in row if t.strip()) for rank, row in enumerate(texts))
    except _Refusal as err:
        raise _refused(source, err) from None
    return checked(CustomSchedule(rows, source, read_from))


def checked(schedule: CustomSchedule) -> CustomSchedule:
    """``schedule``, once :func:`check_schedule` finds nothing to refuse (else a :class:`PipelineConfigError`)."""
    try:
        check_schedule(schedule)
    except _Refusal as err:
        raise _refused(schedule.source, err) from None
    return schedule


def _refused(source: str, err: _Refusal) -> PipelineConfigError:
    where = f"rank {err.rank}, action {err.action!r}" if err.action else f"rank {err.rank}"
    return PipelineConfigError(
        f"The schedule in {source} cannot run: {where}: {err.reason} (docs/custom-schedules.md)."
    )


def check_schedule(schedule: CustomSchedule) -> None:
    """Refuse (:class:`_Refusal`) a schedule that names no stage, places stages as no split can, runs an action twice,
    out of order or never, or deadlocks."""
    if not schedule.rows or any(not row for row in schedule.rows):
        rank = next((r for r, row in enumerate(schedule.rows) if not row), 0)
        raise _Refusal(rank, "", "every pipeline rank needs a row of actions")
    _check_placement(schedule)
    _check_each_rank(schedule)
    _check_progress(schedule)


def _check_placement(schedule: CustomSchedule) -> None:
    """Each stage on one rank, stages 0..S-1 all present, S a multiple of the ranks, placed round robin or in a V."""
    held: dict[int, int] = {}
    for rank, row in enumerate(schedule.actions):
        for a in row:
            if held.setdefault(a.stage, rank) != rank:
                raise _Refusal(
                    rank, str(a), f"stage {a.stage} already runs on rank {held[a.stage]}; a stage has one rank"
                )
    p, s = schedule.pipeline_size, schedule.num_stages
    missing = sorted(set(range(s)) - set(held))
    if missing:
        raise _Refusal(0, "", f"stage {missing[0]} runs on no rank (the stages are 0 to {s - 1})")
    if s % p:
        raise _Refusal(0, "", f"{s} stages do not divide among {p} ranks; every rank holds as many stages")
    ranks = [held[i] for i in range(s)]
    if ranks not in (stage_to_rank(s, p, "loop"), stage_to_rank(s, p, "v")):
        loop = stage_to_rank(s, p, "loop")
        stage = next(i for i in range(s) if ranks[i] != loop[i])
        raise _Refusal(
            ranks[stage],
            str(next(a for a in schedule.actions[ranks[stage]] if a.stage == stage)),
            f"stage {stage} on rank {ranks[stage]} places the stages neither round robin (stage s on rank s % {p})"
            " nor in a V (there and back)",
        )


def _check_each_rank(schedule: CustomSchedule) -> None:
    """Every stage runs each microbatch's forward once, then its backward once (``B``, or ``I`` then ``W``)."""
    done: set[Action] = set()
    for rank, row in enumerate(schedule.actions):
        for a in row:
            if a in done:
                raise _Refusal(rank, str(a), "runs twice")
            needs = {"B": "F", "I": "F", "W": "I"}.get(a.kind)
            if needs is not None and Action(a.stage, needs, a.microbatch) not in done:
                raise _Refusal(rank, str(a), f"runs before {Action(a.stage, needs, a.microbatch)} on this rank")
            if a.kind in "BI" and Action(a.stage, "B" if a.kind == "I" else "I", a.microbatch) in done:
                raise _Refusal(rank, str(a), "a microbatch's backward is either B or I then W, not both")
            done.add(a)
    ranks = schedule.stage_ranks()
    for stage in range(schedule.num_stages):
        for m in range(schedule.microbatches):
            for kind, what in (("F", "forward"), ("W" if Action(stage, "I", m) in done else "B", "backward")):
                if Action(stage, kind, m) not in done:
                    raise _Refusal(
                        ranks[stage], "", f"stage {stage} never runs the {what} of microbatch {m} ({stage}{kind}{m})"
                    )


def _ready(a: Action, done: set[Action], last: int) -> Optional[Action]:
    """``None`` where ``a`` can run after ``done``, else the action of another stage it waits for."""
    if a.kind == "F" and a.stage > 0 and Action(a.stage - 1, "F", a.microbatch) not in done:
        return Action(a.stage - 1, "F", a.microbatch)
    if a.kind in "BI" and a.stage < last:
        after = {Action(a.stage + 1, k, a.microbatch) for k in "BI"}
        if not after & done:
            return Action(a.stage + 1, "B", a.microbatch)
    return None


def _check_progress(schedule: CustomSchedule) -> None:
    """Run the ranks' rows against each other (a receive waits for its send, sends never wait; what torch's lowering
    and runtime assume) and refuse a schedule in which no rank can go on: a deadlock."""
    rows, last = schedule.rows, schedule.num_stages - 1
    position, done = [0] * len(rows), set()
    while any(position[r] < len(rows[r]) for r in range(len(rows))):
        progress = False
        for r, row in enumerate(rows):
            while position[r] < len(row) and all(_ready(a, done, last) is None for a in row[position[r]]):
                done.update(row[position[r]])
                position[r] += 1
                progress = True
        if not progress:
            stuck = [r for r in range(len(rows)) if position[r] < len(rows[r])]
            waits = []
            for r in stuck:
                cell = rows[r][position[r]]
                wanted = next(w for w in (_ready(a, done, last) for a in cell) if w is not None)
                waits.append(f"rank {r} waits at {cell_text(cell)} for {wanted}")
            first = rows[stuck[0]][position[stuck[0]]]
            raise _Refusal(stuck[0], cell_text(first), f"the schedule deadlocks: {'; '.join(waits)}")
