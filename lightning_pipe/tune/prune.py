"""Which candidate to measure next, which one wins, and the table that says why.

The tuner measures one candidate at a time: the one predicted fastest among those not yet measured that fit the
memory limit (:func:`next_trial`), as long as its prediction is within ``margin`` of the prediction for the fastest
candidate measured so far (predictions are compared with predictions: the model's errors are alike for similar
settings, and a measured step carries the machine's noise of its moment). Compiled candidates are predicted as
their eager twins until a compiled trial measured the difference, and come right after their twin. The winner is
the fastest measured candidate within the memory limit (:func:`choose`). Every other candidate gets the reason it was
not measured or not chosen (:func:`rows`).

Pure: no process group.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_pipe.measure.memory import format_bytes
from lightning_pipe.tune.cost import Prediction
from lightning_pipe.tune.space import Candidate

MEASURED, CHOSEN = "measured", "chosen"
OVER_MEMORY, OVER_MEMORY_MEASURED = "over the memory limit (predicted)", "over the memory limit (measured)"
SLOWER, UNTRIED = "predicted slower", "not measured (trial budget spent)"


@dataclass(frozen=True)
class Measured:
    """What a trial measured: median wall and CPU seconds per step, peak bytes of the worst rank."""

    step: float
    cpu: float
    peak: float
    steps: int = 0


@dataclass(frozen=True)
class Row:
    candidate: Candidate
    prediction: Prediction | None
    measured: Measured | None
    status: str


def fits(bytes_needed: float, memory_limit: float | None) -> bool:
    return memory_limit is None or bytes_needed <= memory_limit


def next_trial(
    predictions: Mapping[Candidate, Prediction],
    measured: Mapping[Candidate, Measured],
    memory_limit: float | None,
    margin: float,
) -> Candidate | None:
    """The candidate to measure next, or ``None`` when no unmeasured candidate is worth a trial."""
    winner = choose(measured, memory_limit)
    best = predictions[winner].step if winner in predictions else math.inf
    open_ = [c for c, p in predictions.items() if c not in measured and fits(p.peak, memory_limit)]
    # Ties (a compiled twin before its compile factor is known) go to the eager candidate first.
    for candidate in sorted(open_, key=lambda c: (predictions[c].step, c.compile, c)):
        if predictions[candidate].step <= best * (1 + margin):
            return candidate
        break
    return None


def choose(measured: Mapping[Candidate, Measured], memory_limit: float | None) -> Candidate | None:
    """The fastest measured candidate within the memory limit (``None``: none fits)."""
    ok = [c for c, m in measured.items() if fits(m.peak, memory_limit)]
    return min(ok, key=lambda c: (measured[c].step, c)) if ok else None


def rows(
    predictions: Mapping[Candidate, Prediction],
    measured: Mapping[Candidate, Measured],
    chosen: Candidate | None,
    memory_limit: float | None,
) -> list[Row]:
    """One row per candidate: measured ones first (fastest first), then the rest by predicted step time."""
    out = []
    for candidate, prediction in predictions.items():
        m = measured.get(candidate)
        if candidate == chosen:
            status = CHOSEN
        elif m is not None:
            status = MEASURED if fits(m.peak, memory_limit) else OVER_MEMORY_MEASURED
        elif not fits(prediction.peak, memory_limit):
            status = OVER_MEMORY
        else:
            best = min((x.step for x in measured.values()), default=math.inf)
            status = SLOWER if prediction.step > best else UNTRIED
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
                f"{m.step * 1e3:.1f}" if m else "-",
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
