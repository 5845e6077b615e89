"""How sure a choice between measured candidates is, and which candidates to measure again to make it surer.

One trial's median step carries the machine's noise of its moment: on a busy 2-core machine the same candidate
measured 1.3 times apart from one trial to the next, and one short trial per candidate then decides by chance
between close ones. The noise of a trial is measured, not assumed: the spread (standard deviation of the logarithm)
of the trial medians of candidates measured more than once, pooled; before any candidate was measured twice, the
spread of single steps within a trial stands in for it (a conservative stand-in: a trial's median varies less than
its steps, unless the machine drifts between trials). It is never taken below what the steps' spread allows for a
median of that many steps.

A candidate's estimate is the geometric mean of its trial medians. Another candidate is *within the noise* of the
leader when the 95% interval of the ratio of their estimates contains 1 (a normal approximation on the logarithms:
``log ratio ± 1.96 σ √(1/n₁ + 1/n₂)``, ``n`` trials each). Such candidates are measured again with the leader, one
trial each in turn (:func:`contenders`), until none is left within the noise or the trial budget is spent; the
choice then carries the probability that it is faster than the closest other candidate and that ratio's interval
(:func:`sureness`).

Pure: numbers in, numbers out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_pipe.tune.space import Candidate

#: two-sided 95% normal quantile
Z95 = 1.959964


@dataclass(frozen=True)
class Runs:
    """A candidate's trials as the noise model reads them."""

    #: each trial's median step (seconds)
    medians: tuple[float, ...]
    #: each trial's spread of single steps: the standard deviation of their logarithms
    jitter: tuple[float, ...] = ()
    #: measured steps per trial
    steps: int = 1

    @property
    def estimate(self) -> float:
        """The geometric mean of the trial medians."""
        return math.exp(statistics.fmean(math.log(m) for m in self.medians))


def step_jitter(seconds: Sequence[float]) -> float:
    """The standard deviation of the logarithms of ``seconds`` (0 for fewer than two steps)."""
    logs = [math.log(s) for s in seconds if s > 0]
    return statistics.stdev(logs) if len(logs) > 1 else 0.0


def trial_noise(runs: Mapping[Candidate, Runs]) -> float:
    """The standard deviation of the logarithm of one trial's median step, measured as the module docstring says."""
    squares, dof = 0.0, 0
    for r in runs.values():
        if len(r.medians) > 1:
            logs = [math.log(m) for m in r.medians]
            mean = statistics.fmean(logs)
            squares += sum((x - mean) ** 2 for x in logs)
            dof += len(logs) - 1
    jitters = [j for r in runs.values() for j in r.jitter]
    steps = [r.steps for r in runs.values()]
    jitter = statistics.median(jitters) if jitters else 0.0
    # The median of n steps varies about 1.25 / sqrt(n) times as much as one step.
    floor = 1.25 * jitter / math.sqrt(max(statistics.median(steps), 1)) if steps else 0.0
    if dof >= 2:
        return max(math.sqrt(squares / dof), floor)
    return jitter


def _z(leader: Runs, other: Runs, noise: float) -> float:
    """How many standard errors ``other``'s estimate lies above ``leader``'s (``inf``: no noise at all)."""
    gap = math.log(other.estimate) - math.log(leader.estimate)
    error = noise * math.sqrt(1 / len(leader.medians) + 1 / len(other.medians))
    if error == 0:
        return math.inf if gap > 0 else (0.0 if gap == 0 else -math.inf)
    return gap / error


def contenders(runs: Mapping[Candidate, Runs], leader: Candidate, count: int) -> list[Candidate]:
    """The candidates of ``runs`` whose estimates lie within the noise of ``leader``'s (closest first, at most
    ``count``): each should be measured again with the leader. Empty when the leader stands out."""
    noise = trial_noise(runs)
    close = [(_z(runs[leader], r, noise), c) for c, r in runs.items() if c != leader]
    close = [(z, c) for z, c in close if z < Z95]
    return [c for _, c in sorted(close, key=lambda zc: (zc[0], zc[1]))][:count]


@dataclass(frozen=True)
class Sureness:
    """How sure the choice is against the closest other measured candidate (``rival``)."""

    rival: Candidate | None = None
    #: the rival's estimate over the choice's, and that ratio's 95% interval
    ratio: float = math.inf
    low: float = math.inf
    high: float = math.inf
    #: the probability that the choice is faster than the rival (normal approximation)
    probability: float = 1.0
    #: the standard deviation of the logarithm of one trial's median step (the measured noise)
    noise: float = 0.0
    #: whether the rival still lies within the noise (the trial budget was spent first)
    within_noise: bool = False

    def as_dict(self) -> dict[str, object]:
        return {
            "rival": self.rival.label if self.rival is not None else None,
            "ratio": self.ratio,
            "interval": [self.low, self.high],
            "probability": self.probability,
            "noise": self.noise,
            "within_noise": self.within_noise,
        }

    def describe(self) -> str:
        if self.rival is None:
            return "no other candidate measured within the memory limit"
        verdict = "within the noise: the trial budget was spent first" if self.within_noise else "outside the noise"
        return (
            f"{self.probability:.0%} sure against the closest, {self.rival.label}: {self.ratio:.3f} times its step"
            f" (95% interval {self.low:.3f}-{self.high:.3f}; {verdict}; trial noise {self.noise:.1%})"
        )


def sureness(runs: Mapping[Candidate, Runs], choice: Candidate) -> Sureness:
    """How sure ``choice`` is against the closest other candidate of ``runs``."""
    noise = trial_noise(runs)
    others = [c for c in runs if c != choice]
    if not others:
        return Sureness(noise=noise)
    rival = min(others, key=lambda c: (_z(runs[choice], runs[c], noise), c))
    mine, theirs = runs[choice], runs[rival]
    ratio = theirs.estimate / mine.estimate
    error = noise * math.sqrt(1 / len(mine.medians) + 1 / len(theirs.medians))
    z = _z(mine, theirs, noise)
    probability = 0.5 * (1 + math.erf(z / math.sqrt(2))) if math.isfinite(z) else float(z > 0)
    return Sureness(
        rival,
        ratio,
        ratio * math.exp(-Z95 * error),
        ratio * math.exp(Z95 * error),
        probability,
        noise,
        z < Z95,
    )
