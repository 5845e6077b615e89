"""The per-microbatch cost: the strategy's step time against the microbatch count, beside the hand loop's.

    python benchmarks/microbatches.py           # 6 rounds x 3 counts, ~4 minutes on 2 busy cores; rewrites its section
    python benchmarks/microbatches.py --quick   # every code path once (CI smoke), docs untouched

The small network (4 x Linear(256) + ReLU, batch 64), GPipe (the one schedule torch runs with 1 microbatch on 2
stages), M = 1, 4 and 16 microbatches, 2 processes x 1 thread, each pinned to a core of its own. Each training
alternates the two loops step by step in the same processes (benchmarks/phase_timing.py's ``interleaved``: a hand
step, then a strategy step, and so on), so both are timed within the same second; a round trains each count once,
in an order reversed every other round.

Per round and loop, the slope is the least-squares line of the median step (wall clock, rank 0) over M: what one
more microbatch costs. The strategy's slope minus the hand loop's is paired round by round, and the report gives its
mean and 95% interval over the rounds (benchmarks/stats.py), with the per-count differences (the intercept, the fixed
cost per step, is benchmarks/phases.py's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.phases import ALTERNATE_ENV, _machine_line  # noqa: E402
from benchmarks.stats import ci, mean_ci  # noqa: E402

BEGIN = "<!-- benchmarks/microbatches.py: begin (generated, do not edit by hand) -->"
END = "<!-- benchmarks/microbatches.py: end -->"
COUNTS = (1, 4, 16)
SCHEDULE = "GPipe"
#: rounds, measured steps and warm-up steps per training (full, quick)
SIZES = {"full": (6, 80, 10), "quick": (1, 2, 1)}


def cases(rounds: int, steps: int, warmup: int, model: str) -> list[dict[str, Any]]:
    """One interleaved training per round and count, the counts' order reversed every other round."""
    out = []
    for r in range(rounds):
        for m in COUNTS if r % 2 == 0 else COUNTS[::-1]:
            out.append(
                {
                    "kind": "phases",
                    "of": "interleaved",
                    "phased": False,
                    "model": model,
                    "suite": "microbatches",
                    "run": r,
                    "steps": steps,
                    "warmup": warmup,
                    "schedule": SCHEDULE,
                    "microbatches": m,
                    "pin": True,
                }
            )
    return out


def slope(counts: list[int], ms: list[float]) -> float:
    """The least-squares slope of ``ms`` over ``counts``."""
    mean_m, mean_t = statistics.fmean(counts), statistics.fmean(ms)
    num = sum((m - mean_m) * (t - mean_t) for m, t in zip(counts, ms))
    return num / sum((m - mean_m) ** 2 for m in counts)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per round: each loop's median step at each count and its slope; over rounds: means with 95% intervals, the
    slope difference and the per-count differences paired round by round."""
    machine = next((rec["machine"] for rec in records if "machine" in rec), None)
    mine = [rec for rec in records if rec.get("case", {}).get("suite") == "microbatches" and "error" not in rec]
    per: dict[int, dict[int, dict[str, float]]] = {}
    for rec in mine:
        steps = rec["steps_ms"]
        per.setdefault(rec["case"]["run"], {})[rec["case"]["microbatches"]] = {
            "hand": statistics.median(steps["hand"]),
            "strategy": statistics.median(steps["strategy"]),
            "diff": statistics.median(s - h for h, s in zip(steps["hand"], steps["strategy"])),
        }
    rounds = [r for r in sorted(per) if set(per[r]) == set(COUNTS)]
    out: dict[str, Any] = {"machine": machine, "rounds": len(rounds), "load": [rec.get("load") for rec in mine]}
    counts = list(COUNTS)
    slopes = {of: [slope(counts, [per[r][m][of] for m in counts]) for r in rounds] for of in ("hand", "strategy")}
    if not rounds:
        return out
    out["slope"] = {of: mean_ci(v) for of, v in slopes.items()}
    out["slope"]["diff"] = mean_ci([s - h for h, s in zip(slopes["hand"], slopes["strategy"])])
    out["per_count"] = {
        str(m): {of: mean_ci([per[r][m][of] for r in rounds]) for of in ("hand", "strategy", "diff")} for m in counts
    }
    return out


def markdown(summary: dict[str, Any], steps: int, warmup: int) -> str:
    lines = [
        BEGIN,
        "",
        "### Results: the per-microbatch cost",
        "",
        f"`python benchmarks/microbatches.py`: {summary['rounds']} rounds, each training {steps} measured steps"
        f" after {warmup}, the loops alternating step by step; {_machine_line(summary)}. Mean over rounds"
        " [95% interval], ms of wall clock per step (rank 0):",
        "",
        "| microbatches | hand loop | strategy | strategy - hand (paired) |",
        "|---|---|---|---|",
    ]
    for m, row in summary.get("per_count", {}).items():
        lines.append(f"| {m} | {ci(row['hand'])} | {ci(row['strategy'])} | {ci(row['diff'])} |")
    s = summary.get("slope")
    if s:
        lines += [
            "",
            f"Slope, ms per extra microbatch: hand loop {ci(s['hand'], 3)}, strategy {ci(s['strategy'], 3)};"
            f" **strategy - hand {ci(s['diff'], 3)}** (paired round by round).",
        ]
    return "\n".join([*lines, "", END])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round of 2 steps, tiny network (CI smoke)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "microbatches")
    parser.add_argument("--docs", type=Path, default=None, help="page to update ('-': none)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the launch")
    parser.add_argument("--report-only", action="store_true", help="rewrite the docs from OUT/microbatches.json")
    args = parser.parse_args(argv)
    rounds, steps, warmup = SIZES["quick" if args.quick else "full"]
    rounds, steps = args.rounds or rounds, args.steps or steps
    if args.docs is None:
        args.docs = Path("-") if args.quick else ROOT / "docs" / "benchmarks.md"
    args.out.mkdir(parents=True, exist_ok=True)
    from benchmarks import report
    from benchmarks.common import launch

    results = args.out / "microbatches.json"
    if args.report_only:
        records = json.loads(results.read_text())["records"]
    else:
        records = launch(
            2, cases(rounds, steps, warmup, "tiny" if args.quick else "small"), args.out, args.timeout, ALTERNATE_ENV
        )
    summary = summarize(records)
    results.write_text(json.dumps({"summary": summary, "records": records, "steps": steps, "warmup": warmup}, indent=1))
    text = markdown(summary, steps, warmup)
    if str(args.docs) != "-":
        report.write_section(args.docs, text, BEGIN, END)
    print(text)
    return summary


if __name__ == "__main__":
    main()
