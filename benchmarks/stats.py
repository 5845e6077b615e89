"""The benchmarks' two targets, and how a verdict is read from a mean's confidence interval.

Every figure compared with a target is a mean over rounds (or runs) with its 95% confidence interval: the target is
met when the whole interval is at or below it, not met when the whole interval is above it, and not established when
the interval contains it (benchmarks/phases.py's blocks and benchmarks/run.py's report both read them so).
"""

from __future__ import annotations

import math
import statistics

#: the fixed cost per step on the small network (ms of wall clock), and the compute-bound ratio: at most these
FIXED_COST_TARGET_MS, RATIO_TARGET = 1.5, 1.02


# t quantiles (two-sided 95%) for 1..30 degrees of freedom
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131]
_T95 += [2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def mean_ci(values: list[float]) -> dict[str, float]:
    """Mean and its 95% confidence interval (Student's t over the values, one per round)."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return {"mean": mean, "low": math.nan, "high": math.nan, "n": n}
    half = (_T95[n - 2] if n - 1 <= len(_T95) else 1.96) * statistics.stdev(values) / math.sqrt(n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}


def ci(value: dict[str, float] | None, digits: int = 2, *, alone: bool = True) -> str:
    """``mean [low, high]`` of a :func:`mean_ci`; with one value the mean alone (``alone``) or ``-``; ``-`` for none."""
    if value is None:
        return "-"
    if value["n"] < 2 or math.isnan(value["low"]):
        return f"{value['mean']:.{digits}f}" if alone else "-"
    return f"{value['mean']:.{digits}f} [{value['low']:.{digits}f}, {value['high']:.{digits}f}]"


def verdict(value: dict[str, float] | None, target: float = RATIO_TARGET, unit: str = "") -> str:
    """What the interval of ``value`` (a ratio, or a difference in ``unit``) says of its target."""
    if value is None or math.isnan(value["low"]):
        return "not established (fewer than 2 rounds)."
    t = f"{target:g}{unit}"
    if value["high"] <= target:
        return f"met: the whole interval is at or below {t} (upper end {value['high']:.3f}{unit})."
    if value["low"] > target:
        return f"not met: the whole interval is above {t} (lower end {value['low']:.3f}{unit})."
    return f"not established: the interval [{value['low']:.3f}, {value['high']:.3f}]{unit} contains {t}."
