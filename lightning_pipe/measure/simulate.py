"""A schedule played out in time: torch's action order per rank, durations we measured, transfers between ranks.

torch decides the order in which each rank runs its forwards (``F``), backwards (``B``: full; ``I``: input gradient)
and weight-gradient backwards (``W``) (:func:`lightning_pipe.compat.torch.schedule_actions`); its own simulator counts
unit time steps. Here every action takes its measured time and starts when its rank is free and what it needs has
arrived: the previous stage's forward of the same microbatch (``F``), the next stage's backward (``B``/``I``; on the
last stage its own forward and loss), its own ``I`` (``W``), plus the transfer time when the two stages live on
different ranks. The result gives a schedule's step time, its bubble and how many microbatches each stage holds
activations for at once (memory), for settings that were never run: the tuner ranks candidates with it, and the
timeline explains a measured bubble with it.

Pure: numbers in, numbers out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Union

from lightning_pipe.schedules.custom import CustomSchedule
from lightning_pipe.schedules.export import builtin_schedule

Action = tuple[int, str, int]
"""``(stage, kind, microbatch)``, kind one of ``"F"``, ``"B"``, ``"I"``, ``"W"``."""


@dataclass(frozen=True)
class StageTimes:
    """Seconds per microbatch of each stage's actions (index = stage)."""

    forward: tuple[float, ...]
    #: full backward (input and weight gradients in one pass)
    backward: tuple[float, ...]
    #: the input-gradient half of a split backward (zero-bubble schedules)
    backward_input: tuple[float, ...]
    #: the weight-gradient half
    backward_weight: tuple[float, ...]
    #: the user's step on the last stage's output (loss), after each of its forwards
    loss: float = 0.0
    #: seconds to move one microbatch's activation (or its gradient) from stage ``s`` to ``s + 1`` when they live on
    #: different ranks (index = s)
    transfer: tuple[float, ...] = ()
    #: added to every action: what running one action costs beyond its compute (Python, hooks, bookkeeping)
    overhead: float = 0.0

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    def duration(self, stage: int, kind: str) -> float:
        table = {"F": self.forward, "B": self.backward, "I": self.backward_input, "W": self.backward_weight}
        seconds = table[kind][stage] + self.overhead
        if kind == "F" and stage == self.num_stages - 1:
            seconds += self.loss
        return seconds

    def hop(self, stage: int) -> float:
        """Transfer time across the boundary between ``stage`` and ``stage + 1``."""
        return self.transfer[stage] if stage < len(self.transfer) else 0.0

    @classmethod
    def uniform(cls, num_stages: int, forward: float, backward_input: float, backward_weight: float) -> StageTimes:
        """Equal stages, no loss, no transfer time: the pipeline of the textbook formula."""
        n = num_stages
        return cls(
            (forward,) * n, (backward_input + backward_weight,) * n, (backward_input,) * n, (backward_weight,) * n
        )


@dataclass(frozen=True)
class Simulation:
    """One simulated step."""

    #: seconds from the first action's start to the last action's end
    span: float
    #: compute seconds of each rank
    busy: tuple[float, ...]
    #: most microbatches whose activations each stage holds at once (from a forward's start to the end of the
    #: backward that frees them: ``B``, or ``W`` when the backward is split)
    in_flight: tuple[int, ...]
    #: ``(rank, stage, kind, microbatch, start, end)`` of every action
    timeline: tuple[tuple[int, int, str, int, float, float], ...]

    @property
    def bubble(self) -> float:
        """Idle fraction of the span, averaged over ranks (as :func:`lightning_pipe.measure.timeline.bubble_fraction`
        measures it)."""
        if self.span <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.span)

    def peak_bytes(self, per_microbatch: Sequence[float], stage_rank: Sequence[int]) -> list[float]:
        """Most activation bytes each rank holds at once, ``per_microbatch[s]`` bytes per live microbatch of stage s."""
        ranks = max(stage_rank) + 1 if stage_rank else 0
        changes: list[list[tuple[float, float]]] = [[] for _ in range(ranks)]
        for start, end, stage in _lifetimes(self.timeline):
            rank = stage_rank[stage]
            changes[rank] += [(start, per_microbatch[stage]), (end, -per_microbatch[stage])]
        return [_peak(events) for events in changes]


def schedule_orders(
    schedule: Union[str, CustomSchedule], pipeline_size: int, microbatches: int, stages_per_rank: int
) -> list[list[Action]]:
    """Each rank's compute actions in the order ``schedule`` runs them (cached). Raises ``ValueError`` for a
    combination torch's schedule refuses (:func:`lightning_pipe.schedules.export.builtin_schedule`: GPipe and 1F1B
    as their ``_step_microbatches`` loops run, the multi-stage schedules in torch's own order). A schedule of one's
    own gives its actions, and only the counts it has."""
    if isinstance(schedule, CustomSchedule):
        shape = (schedule.pipeline_size, schedule.microbatches, schedule.stages_per_rank)
        if shape != (pipeline_size, microbatches, stages_per_rank):
            raise ValueError(
                f"The {schedule} runs {shape[1]} microbatches on {shape[0]} ranks with {shape[2]} stage(s) each."
            )
        return [list(rank) for rank in schedule.actions]  # its actions are tuples too
    return [list(rank) for rank in _orders(schedule, pipeline_size, microbatches, stages_per_rank)]


@lru_cache(maxsize=256)
def _orders(schedule: str, pipeline_size: int, microbatches: int, stages_per_rank: int) -> tuple[tuple[Action, ...]]:
    actions = builtin_schedule(schedule, pipeline_size, microbatches, stages_per_rank).actions
    return tuple(tuple(tuple(a) for a in rank) for rank in actions)  # type: ignore[misc]


def _lifetimes(timeline: Sequence[tuple[int, int, str, int, float, float]]) -> list[tuple[float, float, int]]:
    """``(start, end, stage)`` of each microbatch's activations: from its forward's start to its last backward's end."""
    born: dict[tuple[int, int], float] = {}
    freed: dict[tuple[int, int], float] = {}
    for _rank, stage, kind, microbatch, start, end in timeline:
        key = (stage, microbatch)
        if kind == "F":
            born[key] = start
        else:
            freed[key] = max(freed.get(key, end), end)
    return [(start, freed.get(key, start), key[0]) for key, start in born.items()]


def _peak(changes: list[tuple[float, float]]) -> float:
    # Frees before allocations at one instant: a backward that ends as a forward starts does not overlap it.
    level = peak = 0.0
    for _, delta in sorted(changes, key=lambda c: (c[0], c[1])):
        level += delta
        peak = max(peak, level)
    return peak


def _needs(action: Action, times: StageTimes, stage_rank: Sequence[int], done: Mapping[Action, float]) -> float | None:
    """When ``action``'s inputs are there (``None``: not yet known)."""
    stage, kind, microbatch = action
    last = times.num_stages - 1

    def arrival(source: Action, boundary: int) -> float | None:
        end = done.get(source)
        if end is None:
            return None
        return end + (times.hop(boundary) if stage_rank[source[0]] != stage_rank[stage] else 0.0)

    if kind == "F":
        return 0.0 if stage == 0 else arrival((stage - 1, "F", microbatch), stage - 1)
    if kind == "W":
        return done.get((stage, "I", microbatch))
    own = done.get((stage, "F", microbatch))
    if own is None or stage == last:
        return own
    after = arrival((stage + 1, "I", microbatch), stage)
    if after is None:
        after = arrival((stage + 1, "B", microbatch), stage)
    return None if after is None else max(own, after)


def simulate(orders: Sequence[Sequence[Action]], times: StageTimes, stage_rank: Sequence[int]) -> Simulation:
    """Play ``orders`` (each rank's actions, in torch's order) with ``times``; ``stage_rank[s]`` is stage s's rank.

    Raises ``ValueError`` if no rank can go on (orders that deadlock, or that name a stage outside ``times``).
    """
    ranks = len(orders)
    done: dict[Action, float] = {}
    position = [0] * ranks
    free = [0.0] * ranks
    busy = [0.0] * ranks
    timeline: list[tuple[int, int, str, int, float, float]] = []
    remaining = sum(len(order) for order in orders)
    while remaining:
        moved = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                action = tuple(order[position[rank]])
                ready = _needs(action, times, stage_rank, done)  # type: ignore[arg-type]
                if ready is None:
                    break
                stage, kind, microbatch = action
                seconds = times.duration(stage, kind)
                start = max(free[rank], ready)
                free[rank] = done[action] = start + seconds  # type: ignore[index]
                busy[rank] += seconds
                timeline.append((rank, stage, kind, microbatch, start, start + seconds))
                position[rank] += 1
                remaining -= 1
                moved = True
        if not moved:
            stuck = [tuple(o[p]) for o, p in zip(orders, position) if p < len(o)]
            raise ValueError(f"The schedule cannot go on: every rank waits ({stuck}).")
    in_flight = [0] * times.num_stages
    for stage in range(times.num_stages):
        spans = [(start, end) for start, end, s in _lifetimes(timeline) if s == stage]
        in_flight[stage] = int(_peak([(a, 1.0) for a, _ in spans] + [(b, -1.0) for _, b in spans]))
    span = max((t[5] for t in timeline), default=0.0)
    return Simulation(span, tuple(busy), tuple(in_flight), tuple(timeline))


# ---------------------------------------------------------------------------------------------------- the bubble
@dataclass(frozen=True)
class BubbleGap:
    """A measured bubble taken apart, each part a simulation of the recorded step with one more cause in it."""

    #: ``(K - 1) / (v * M + K - 1)``
    theory: float
    #: the schedule's own bubble with every stage taking the stages' mean time per action, no loss, no transfer
    #: time (the formula for GPipe/1F1B/interleaved; below it for the zero-bubble schedules)
    schedule: float
    #: what the last stage's loss (the user's step on each output) adds
    loss: float
    #: what unequal stages add (each stage its own measured times)
    imbalance: float
    #: the rest of the measured bubble: transfers between ranks, waiting on them, the strategy's and torch's work
    #: between actions (and, on a shared machine, other processes)
    other: float
    measured: float

    def describe(self) -> str:
        return (
            f"measured bubble {self.measured:.1%} = schedule {self.schedule:.1%} (theory {self.theory:.1%})"
            f" + last stage's loss {self.loss:+.1%} + stage imbalance {self.imbalance:+.1%}"
            f" + communication and other {self.other:+.1%}"
        )


def explain_bubble(
    durations: Mapping[tuple[int, str], float],
    measured: float,
    schedule: Union[str, Sequence[Sequence[Action]]],
    pipeline_size: int,
    microbatches: int,
    stages_per_rank: int,
    stage_rank: Sequence[int],
) -> BubbleGap:
    """Take ``measured`` (a step's bubble) apart, from ``durations``: the recorded median seconds of each ``(stage,
    kind)`` action (kinds ``F``, ``B``, ``W``, ``L`` as the timeline records them; ``B`` is the input-gradient half
    when ``W`` actions exist). ``schedule``: a torch schedule's name, or each rank's actions (a schedule of one's
    own)."""
    from lightning_pipe.measure.timeline import theoretical_bubble

    stages = pipeline_size * stages_per_rank
    split = any(kind == "W" for _, kind in durations)

    def per_stage(kind: str) -> list[float]:
        return [durations.get((s, kind), 0.0) for s in range(stages)]

    forward, backward, weight = per_stage("F"), per_stage("B"), per_stage("W")
    full = [b + w for b, w in zip(backward, weight)] if split else backward
    loss = durations.get((stages - 1, "L"), 0.0)
    if isinstance(schedule, str):
        orders = schedule_orders(schedule, pipeline_size, microbatches, stages_per_rank)
    else:
        orders = [list(rank) for rank in schedule]

    def bubble(f: Sequence[float], i: Sequence[float], w: Sequence[float], b: Sequence[float], lost: float) -> float:
        times = StageTimes(tuple(f), tuple(b), tuple(i), tuple(w), loss=lost)
        return simulate(orders, times, stage_rank).bubble

    def mean(values: list[float]) -> list[float]:
        return [sum(values) / len(values)] * len(values)

    equal = bubble(mean(forward), mean(backward), mean(weight), mean(full), 0.0)
    with_loss = bubble(mean(forward), mean(backward), mean(weight), mean(full), loss)
    unequal = bubble(forward, backward, weight, full, loss)
    return BubbleGap(
        theory=theoretical_bubble(pipeline_size, microbatches, stages_per_rank),
        schedule=equal,
        loss=with_loss - equal,
        imbalance=unequal - with_loss,
        other=measured - unequal,
        measured=measured,
    )
