"""Which candidate to measure next, which one wins, and the table that says why.

The cost model's errors are alike for candidates whose actions have the same size (the same microbatch count and
stages per rank, a :func:`group`): how the compute of a microbatch changes with its size, and what an action costs
beyond its compute, are what the model gets least right. So the predictions of a group with measured candidates are
scaled by what those measured over what they were predicted (:func:`corrected`), and a group with no measurement yet
goes first among the candidates worth a trial: one trial there corrects the whole group.

The tuner measures one candidate at a time (:func:`next_trial`): among those not yet measured that fit the memory
limit and are predicted within ``margin`` of the prediction for the fastest candidate measured so far (twice
``margin`` in a group not measured yet; predictions are compared with predictions, and a measured step carries the
machine's noise of its moment), the fastest of an unmeasured group, else the fastest. Compiled candidates are
predicted as their eager twins until a compiled trial measured the difference, and come right after their twin. The
measured candidates within the measured noise of the fastest are measured again with it, in rounds
(:func:`repeat_round`, :mod:`.noise`), and the winner is the fastest measured candidate within the memory limit
(:func:`choose`), on all its trials, with how sure it is (:func:`how_sure`). Every other candidate gets the reason it
was not measured or not chosen (:func:`rows`).

Pure: no process group.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_pipe.measure.memory import format_bytes
from lightning_pipe.tune.cost import Prediction
from lightning_pipe.tune.noise import Runs, Sureness, contenders, sureness
from lightning_pipe.tune.space import Candidate

MEASURED, CHOSEN = "measured", "chosen"
OVER_MEMORY, OVER_MEMORY_MEASURED = "over the memory limit (predicted)", "over the memory limit (measured)"
SLOWER, UNTRIED = "predicted slower", "not measured (trial budget spent)"


@dataclass(frozen=True)
class Measured:
    """What a candidate's trials measured: wall seconds per step (the geometric mean of the trials' medians), median
    CPU seconds per step, peak bytes of the worst rank."""

    step: float
    cpu: float
    peak: float
    steps: int = 0
    trials: int = 1
    #: each trial's median wall seconds per step, and its steps' spread (:func:`.noise.step_jitter`)
    runs: tuple[float, ...] = ()
    jitter: tuple[float, ...] = ()


@dataclass(frozen=True)
class Row:
    candidate: Candidate
    prediction: Prediction | None
    measured: Measured | None
    status: str


def fits(bytes_needed: float, memory_limit: float | None) -> bool:
    return memory_limit is None or bytes_needed <= memory_limit


def group(candidate: Candidate) -> tuple:
    """Candidates whose actions have the same size, and whose predictions are wrong alike (in one layout: another
    layout's communication and per-replica batch are modelled, not measured, until one of its candidates runs)."""
    return (
        candidate.microbatches,
        candidate.stages_per_rank,
        candidate.compile,
        candidate.pipeline_size,
        candidate.data_parallel,
        candidate.tensor_parallel,
    )


def corrected(
    predictions: Mapping[Candidate, Prediction], measured: Mapping[Candidate, Measured]
) -> dict[Candidate, Prediction]:
    """``predictions`` with each group's step times scaled by the median of its measured candidates' measured over
    predicted step (a group with no measurement keeps the model's prediction)."""
    ratios: dict[tuple, list[float]] = {}
    for candidate, m in measured.items():
        if candidate in predictions and predictions[candidate].step > 0:
            ratios.setdefault(group(candidate), []).append(m.step / predictions[candidate].step)
    out = {}
    for candidate, p in predictions.items():
        found = ratios.get(group(candidate))
        out[candidate] = dataclasses.replace(p, step=p.step * statistics.median(found)) if found else p
    return out


def layout_of(candidate: Candidate) -> tuple:
    """The layout a candidate runs in (``(0, "", 0)`` for all of them when the space keeps the strategy's own)."""
    return (candidate.pipeline_size, candidate.data_parallel, candidate.tensor_parallel)


def untried_layouts(
    predictions: Mapping[Candidate, Prediction], measured: Mapping[Candidate, Measured], memory_limit: float | None
) -> list[Candidate]:
    """For each layout none of whose candidates has run, its fastest predicted candidate within the memory limit,
    fastest first. A layout's communication and per-replica compute are modelled, not measured, until one of its
    candidates runs, and the model can be wrong by more than the margin (on a busy 2-core machine it predicted no
    pipeline at 1.22 times a measured 2-stage pipeline's step, where a sweep measured 0.87): every layout gets one
    trial."""
    tried = {layout_of(c) for c in measured}
    open_ = [c for c, p in predictions.items() if c not in measured and fits(p.peak, memory_limit)]
    open_.sort(key=lambda c: (predictions[c].step, c.compile, c))
    firsts: dict[tuple, Candidate] = {}
    for c in open_:
        if layout_of(c) not in tried:
            firsts.setdefault(layout_of(c), c)
    return list(firsts.values())


def worth_a_trial(
    predictions: Mapping[Candidate, Prediction],
    measured: Mapping[Candidate, Measured],
    memory_limit: float | None,
    margin: float,
) -> list[Candidate]:
    """The unmeasured candidates within the memory limit predicted within ``margin`` of the prediction for the
    fastest measured one (twice ``margin`` for a group not measured yet, whose prediction is not corrected), and the
    fastest predicted candidate of each layout not measured yet (:func:`untried_layouts`), fastest first."""
    winner = choose(measured, memory_limit)
    best = predictions[winner].step if winner in predictions else math.inf
    tried = {group(c) for c in measured}
    open_ = [c for c, p in predictions.items() if c not in measured and fits(p.peak, memory_limit)]
    # Ties (a compiled twin before its compile factor is known) go to the eager candidate first.
    open_.sort(key=lambda c: (predictions[c].step, c.compile, c))
    firsts = set(untried_layouts(predictions, measured, memory_limit))
    return [
        c
        for c in open_
        if c in firsts or predictions[c].step <= best * (1 + (margin if group(c) in tried else 2 * margin))
    ]


def next_trial(
    predictions: Mapping[Candidate, Prediction],
    measured: Mapping[Candidate, Measured],
    memory_limit: float | None,
    margin: float,
) -> Candidate | None:
    """The candidate to measure next, or ``None`` when no unmeasured candidate is worth a trial. ``predictions``:
    already :func:`corrected`."""
    worth = worth_a_trial(predictions, measured, memory_limit, margin)
    tried = {group(c) for c in measured}
    fresh = [c for c in worth if group(c) not in tried]
    # Once the first trial has run: every layout's first trial before the rest (see untried_layouts).
    layouts = untried_layouts(predictions, measured, memory_limit) if measured else []
    return (layouts or fresh or worth or [None])[0]


def noise_runs(measured: Mapping[Candidate, Measured], memory_limit: float | None) -> dict[Candidate, Runs]:
    """The measured candidates within the memory limit, as :mod:`.noise` reads them."""
    return {
        c: Runs(m.runs or (m.step,), m.jitter, max(m.steps // max(m.trials, 1), 1))
        for c, m in measured.items()
        if fits(m.peak, memory_limit)
    }


def repeat_round(measured: Mapping[Candidate, Measured], memory_limit: float | None, count: int) -> list[Candidate]:
    """The next round of repeated trials: the leader (:func:`choose`) and the candidates within the measured noise
    of it (:func:`.noise.contenders`), at most ``count`` trials in all; none when fewer than two (a trial of the
    leader alone would not change the choice)."""
    leader = choose(measured, memory_limit)
    if leader is None or count < 2:
        return []
    close = contenders(noise_runs(measured, memory_limit), leader, count - 1)
    return [leader, *close] if close else []


def how_sure(measured: Mapping[Candidate, Measured], memory_limit: float | None, choice: Candidate) -> Sureness:
    """How sure ``choice`` is against the closest other measured candidate within the memory limit."""
    return sureness(noise_runs(measured, memory_limit), choice)


def choose(measured: Mapping[Candidate, Measured], memory_limit: float | None) -> Candidate | None:
    """The fastest measured candidate within the memory limit (``None``: none fits)."""
    ok = [c for c, m in measured.items() if fits(m.peak, memory_limit)]
    return min(ok, key=lambda c: (measured[c].step, c)) if ok else None


def rows(
    predictions: Mapping[Candidate, Prediction],
    measured: Mapping[Candidate, Measured],
    chosen: Candidate | None,
    memory_limit: float | None,
    margin: float = 0.0,
) -> list[Row]:
    """One row per candidate: measured ones first (fastest first), then the rest by predicted step time. An
    unmeasured candidate predicted within ``margin`` of the prediction for the choice was left for the trial budget."""
    out = []
    worth = set(worth_a_trial(predictions, measured, memory_limit, margin))
    for candidate, prediction in predictions.items():
        m = measured.get(candidate)
        if candidate == chosen:
            status = CHOSEN
        elif m is not None:
            status = MEASURED if fits(m.peak, memory_limit) else OVER_MEMORY_MEASURED
        elif not fits(prediction.peak, memory_limit):
            status = OVER_MEMORY
        else:
            status = UNTRIED if candidate in worth else SLOWER
        out.append(Row(candidate, prediction, m, status))
    for candidate, m in measured.items():
        if candidate not in predictions:  # the user's own setting, outside the search space
            out.append(Row(candidate, None, m, CHOSEN if candidate == chosen else MEASURED))
    return sorted(out, key=lambda r: (r.measured is None, r.measured.step if r.measured else r.prediction.step))


def table(found: Sequence[Row], limit: int | None = 12) -> str:
    """The rows as text: candidate, predicted and measured ms per step, predicted and measured peak memory, status.
    ``limit``: rows shown (the measured ones and the best predicted), the rest summarised by status."""
    shown = list(found) if limit is None else [r for r in found if r.measured is not None]
    if limit is not None:
        shown += [r for r in found if r.measured is None][: max(limit - len(shown), 0)]
    head = ("candidate", "predicted ms", "measured ms", "predicted peak", "measured peak", "")
    lines = [head]
    for r in shown:
        p, m = r.prediction, r.measured
        lines.append(
            (
                r.candidate.label,
                f"{p.step * 1e3:.1f}" if p else "-",
                (f"{m.step * 1e3:.1f}" + (f" ({m.trials} trials)" if m.trials > 1 else "")) if m else "-",
                format_bytes(p.peak) if p else "-",
                format_bytes(m.peak) if m else "-",
                r.status,
            )
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    text = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in lines]
    text.insert(1, "-+-".join("-" * w for w in widths))
    rest = [r for r in found if r not in shown]
    if rest:
        counts: dict[str, int] = {}
        for r in rest:
            counts[r.status] = counts.get(r.status, 0) + 1
        text.append(f"... and {len(rest)} more: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return "\n".join(text)
