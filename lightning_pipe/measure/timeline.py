"""What each rank of a pipeline did during a training step, and when: recording, the bubble, a Chrome trace.

A :class:`TimelineRecorder` attached to a rank's stages (:meth:`PipelineRuntime.attach_timeline
<lightning_pipe.step.runtime.PipelineRuntime.attach_timeline>`) receives one event per schedule action that torch runs
on that rank: each forward (``F``), backward (``B``: the full backward, or the input-gradient half under a
zero-bubble schedule), weight-gradient backward (``W``) and the loss of the last stage (``L``: the user's step on
the microbatch's output), and the point-to-point operations around them (``recv``: from the moment the schedule
posted a receive to the moment the action that needs it started; ``send``: the moment a send was posted). With no
recorder attached nothing is measured: the stage checks one attribute per action.

The rest of the module is pure: the measured bubble of a step from every rank's events, the theoretical bubble of a
schedule, and the Chrome-trace/Perfetto JSON of a set of steps (one process track per rank).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

#: compute actions (busy time); everything else a rank does inside a step is communication or idle
COMPUTE = ("F", "B", "W", "L")
KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient", "L": "loss", "recv": "recv", "send": "send"}


class Event(NamedTuple):
    """One action of one rank: times in ns since the recorder's origin (the same instant on every rank)."""

    step: int
    kind: str
    stage: int
    microbatch: int
    start: int
    end: int


class TimelineRecorder:
    """Collects this rank's events; :attr:`step` is set by whoever drives the steps (the callback).

    ``origin`` is a ``time.perf_counter_ns()`` value taken right after a barrier of the pipeline's ranks, so event
    times of different ranks share one time axis (to within the barrier's release skew, tens of microseconds).
    """

    def __init__(self, origin: int | None = None) -> None:
        self.origin = time.perf_counter_ns() if origin is None else origin
        self.events: list[Event] = []
        #: the training step being recorded; ``None`` records nothing (e.g. outside the steps one asked for)
        self.step: int | None = None
        self._posted: dict[tuple[str, int, int], int] = {}

    @staticmethod
    def now() -> int:
        return time.perf_counter_ns()

    def compute(self, kind: str, stage: int, microbatch: int, start: int) -> None:
        """Record a compute action that began at ``start`` and ends now; closes the receive it waited for."""
        end = time.perf_counter_ns()
        if self.step is None:
            return
        posted = self._posted.pop((kind, stage, microbatch), None)
        if posted is not None:
            self.events.append(Event(self.step, "recv", stage, microbatch, posted - self.origin, start - self.origin))
        self.events.append(Event(self.step, kind, stage, microbatch, start - self.origin, end - self.origin))

    def posted(self, op: str, kind: str, stage: int, microbatch: int) -> None:
        """A receive (``op="recv"``) for action ``kind`` of ``microbatch`` was posted, or a send after it."""
        if self.step is None:
            return
        now = time.perf_counter_ns()
        if op == "recv":
            self._posted[(kind, stage, microbatch)] = now
        else:
            self.events.append(Event(self.step, "send", stage, microbatch, now - self.origin, now - self.origin))

    def take(self) -> list[Event]:
        """The events recorded so far (and forget them)."""
        events, self.events = self.events, []
        return events


# ---------------------------------------------------------------------------------------------------- analysis
@dataclass(frozen=True)
class StepSummary:
    """One rank's share of one step: first action start, last action end and busy time (compute), in ns."""

    step: int
    first: int
    last: int
    busy: int


def summarize(events: Iterable[Event]) -> dict[int, StepSummary]:
    """Per step, the span and the busy (compute) time of one rank's events."""
    out: dict[int, StepSummary] = {}
    for e in events:
        if e.kind not in COMPUTE:
            continue
        s = out.get(e.step)
        if s is None:
            out[e.step] = StepSummary(e.step, e.start, e.end, e.end - e.start)
        else:
            out[e.step] = StepSummary(e.step, min(s.first, e.start), max(s.last, e.end), s.busy + e.end - e.start)
    return out


def bubble_fraction(per_rank: Sequence[StepSummary]) -> float:
    """The measured bubble of one step: the fraction of the step's span (first action of any rank to the last action
    of any rank) that the ranks spend outside compute actions, averaged over the ranks."""
    first = min(s.first for s in per_rank)
    last = max(s.last for s in per_rank)
    span = last - first
    if span <= 0:
        return 0.0
    return 1.0 - sum(s.busy for s in per_rank) / (len(per_rank) * span)


def theoretical_bubble(pipeline_size: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of a step with ``K`` ranks, ``M`` microbatches and ``v`` stages per rank (equal stages, no
    communication time): ``(K - 1) / (v * M + K - 1)``, i.e. ``(K - 1) / (M + K - 1)`` for GPipe and 1F1B and a
    bubble ``v`` times shorter for interleaved schedules (Narayanan et al., 2021). Zero-bubble schedules (which split
    the backward) can go below it."""
    k, m, v = pipeline_size, microbatches, stages_per_rank
    return (k - 1) / (v * m + k - 1)


def ideal_speedup(pipeline_size: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Speedup of a ``K``-rank pipeline over one process running the same ``M`` microbatches through the whole
    model, without communication: ``K * M / (M + (K - 1) / v)``."""
    k, m, v = pipeline_size, microbatches, stages_per_rank
    return k * m / (m + (k - 1) / v)


def step_bubbles(per_rank_events: Sequence[Iterable[Event]]) -> dict[int, float]:
    """Measured bubble of every step that every rank recorded."""
    summaries = [summarize(events) for events in per_rank_events]
    steps = set.intersection(*(set(s) for s in summaries)) if summaries else set()
    return {step: bubble_fraction([s[step] for s in summaries]) for step in sorted(steps)}


def action_durations(events: Iterable[Event]) -> dict[tuple[int, str], float]:
    """Median seconds of each ``(stage, kind)`` compute action in ``events`` (of any ranks and steps)."""
    found: dict[tuple[int, str], list[int]] = {}
    for e in events:
        if e.kind in COMPUTE:
            found.setdefault((e.stage, e.kind), []).append(e.end - e.start)
    return {key: statistics.median(values) / 1e9 for key, values in found.items()}


def chrome_trace(per_rank_events: Sequence[Iterable[Event]], metadata: Mapping[str, Any] | None = None) -> dict:
    """A Chrome-trace/Perfetto JSON object: one process track per rank (``pid`` = pipeline rank) with a ``compute``
    thread (forward, backward, weight-gradient and loss slices named like ``F3``) and a ``p2p`` thread (receive waits
    as slices, sends as instants). Times in microseconds from the recording's origin."""
    trace: list[dict[str, Any]] = []
    for rank, events in enumerate(per_rank_events):
        events = list(events)
        stages = sorted({e.stage for e in events})
        label = f"rank {rank}" + (f" (stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))})")
        trace.append({"ph": "M", "pid": rank, "name": "process_name", "args": {"name": label}})
        trace.append({"ph": "M", "pid": rank, "name": "process_sort_index", "args": {"sort_index": rank}})
        trace.append({"ph": "M", "pid": rank, "tid": 0, "name": "thread_name", "args": {"name": "compute"}})
        trace.append({"ph": "M", "pid": rank, "tid": 1, "name": "thread_name", "args": {"name": "p2p"}})
        for e in events:
            args = {"step": e.step, "stage": e.stage, "microbatch": e.microbatch}
            entry = {"name": f"{e.kind}{e.microbatch}", "cat": KIND_NAMES[e.kind], "pid": rank, "args": args}
            if e.kind == "send":
                trace.append({**entry, "ph": "i", "s": "t", "tid": 1, "ts": e.start / 1e3})
            else:
                tid = 0 if e.kind in COMPUTE else 1
                trace.append({**entry, "ph": "X", "tid": tid, "ts": e.start / 1e3, "dur": (e.end - e.start) / 1e3})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "metadata": dict(metadata or {})}
