"""Every performance figure of docs/benchmarks.md, side by side, from one command.

    python benchmarks/run.py             # the full run (about 14 minutes on 2 CPU cores), rewrites docs/benchmarks.md
    python benchmarks/run.py --quick     # every code path once on a tiny model, docs untouched (CI smoke, ~1 min)

What runs (2 processes unless noted; 1 thread per process; each figure the median of ``--runs`` runs, every run a
fresh Trainer or loop, the runs of different cases interleaved so that a slower moment of the machine hits all alike):

- **overhead**: the strategy against the hand-written loop it replaces (benchmarks/hand.py, the tutorial's loop),
  same network, schedule, microbatches and DataLoader, for GPipe, 1F1B, Interleaved1F1B and ZBVZeroBubble, on a
  compute-bound network (8 x Linear(1024), batch 512, 8 microbatches) and a small one (4 x Linear(256), batch 64,
  4 microbatches), where the fixed cost per step shows; plus Lightning's own loop against a hand loop on one process,
  and the strategy on a one-process pipeline (no communication: its Python cost alone);
- **speedup**: the pipelined compute-bound network against one process running the same microbatches with gradient
  accumulation, for M = 2, 4, 8, 16, beside the ideal ``K*M / (M + (K-1)/v)``;
- **ddp**: ``strategy="ddp"`` on the same processes (the model fits on one), against one process and the pipeline;
- **eval**: validation through the forward-only executor against one process's validation loop;
- **timeline**: ``PipelineTimeline`` on GPipe (K=2, M=4) and 1F1B/Interleaved1F1B/ZBVZeroBubble (M=8): measured
  bubble against theory, the Gantt charts for the docs, and what recording costs (small network, on vs off);
- **phases**: the small network's fixed cost phase by phase, strategy against hand loop, with its confidence
  interval (benchmarks/phases.py; that module alone: ``python benchmarks/phases.py``).

With the phases suite in the launch, each process is pinned to a core of its own (``benchmarks.common.pin_to_core``).

Results: ``--out`` (default benchmarks/results/) gets ``results.json`` (machine, every case's step times) and the
workers' logs; ``--docs`` (default docs/benchmarks.md) gets its generated section rewritten and ``--img`` (default
docs/img/benchmarks/) the plots. On CUDA (one GPU per process) the same cases run on the GPUs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import phases, report  # noqa: E402
from benchmarks.common import check_devices, launch  # noqa: E402, F401  (check_devices: read from here too)

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"]
SUITES = ["overhead", "speedup", "ddp", "eval", "timeline", "phases"]
#: steps per run of the compute-bound network's strategy and hand-loop pairs (2 warm-up steps before them)
COMPUTE_STEPS = 12


class Plan:
    """The cases of each launch (by number of processes): the runs of every suite, interleaved run by run."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args, self.out = args, out
        self.big, self.small = ("tiny", "tiny") if args.quick else ("compute", "small")
        self.micro = [2, 4] if args.quick else [2, 4, 8, 16]
        self.schedules = ["1F1B", "ZBVZeroBubble"] if args.quick else SCHEDULES
        self.launches: dict[int, list[dict[str, Any]]] = {2: [], 1: []}
        for run in range(args.runs):
            for suite in args.suites:
                getattr(self, suite)(run)

    def add(self, nprocs: int, kind: str, model: str, suite: str, run: int, **kw: Any) -> dict[str, Any]:
        quick, small = self.args.quick, model == self.small and suite in ("small", "timeline_cost")
        steps, warmup = (1, 1) if quick else ((60, 5) if small else (6, 2))
        case = {"kind": kind, "model": model, "suite": suite, "steps": steps, "warmup": warmup, "run": run, **kw}
        if nprocs == 1 and kind not in ("hand", "strategy"):
            # One-process cases run inside the 2-process launch, next to the cases they are compared with (the
            # other process waits); only the one-stage pipelines need a launch of their own (a process group of 1).
            case["procs"] = 1
            nprocs = 2
        self.launches[nprocs].append(case)
        return case

    def overhead(self, run: int) -> None:
        # Each strategy case runs next to its hand-loop case, in the order reversed every other run: the machine's
        # drift (minutes long) then hits both sides of a pair alike.
        for schedule in self.schedules:
            for kind in _ordered(("hand", "strategy"), run):
                self.add(2, kind, self.small, "small", run, schedule=schedule, microbatches=4)
        self.add(2, "strategy_log", self.small, "small", run, schedule="1F1B", microbatches=4)
        self.add(2, "strategy_nosigterm", self.small, "small", run, schedule="1F1B", microbatches=4)
        for kind in _ordered(("single_hand", "single_lightning"), run):
            self.add(1, kind, self.small, "small", run, microbatches=1)
        for kind in _ordered(("hand", "strategy"), run):
            self.add(1, kind, self.small, "small", run, schedule="1F1B", microbatches=4, note="one process")
        # The compute-bound pairs (the strategy's case is also the speedup suite's M=8 case): more steps per run than
        # the other compute-bound cases, for the ratio's confidence interval.
        steps = {} if self.args.quick else {"steps": COMPUTE_STEPS}
        for schedule in self.schedules:
            for kind, suite in _ordered((("hand", "overhead"), ("strategy", "speedup")), run):
                self.add(2, kind, self.big, suite, run, schedule=schedule, microbatches=8, **steps)

    def speedup(self, run: int) -> None:
        for m in self.micro:
            for schedule in self.schedules:
                if m != 8 or "overhead" not in self.args.suites:  # (M=8 ran in the overhead suite)
                    self.add(2, "strategy", self.big, "speedup", run, schedule=schedule, microbatches=m)
            self.add(1, "single_hand", self.big, "speedup", run, microbatches=m)

    def ddp(self, run: int) -> None:
        self.add(2, "ddp", self.big, "ddp", run)
        self.add(1, "single_lightning", self.big, "ddp", run, microbatches=1)
        self.add(1, "single_hand", self.big, "ddp", run, microbatches=1)

    def eval(self, run: int) -> None:
        for m in (2, 8):
            self.add(2, "eval_strategy", self.big, "eval", run, schedule="1F1B", microbatches=m)
        self.add(1, "eval_single", self.big, "eval", run)

    def phases(self, run: int) -> None:
        from benchmarks import phases

        steps, warmup = (1, 1) if self.args.quick else (phases.STEPS, phases.WARMUP)
        self.launches[2] += phases.cases([run], steps, warmup, self.small)
        if self.args.quick:  # the two loops alternating step by step (`phases.py --alternate`): its code path once
            self.launches[2] += phases.cases([run], 2, 1, self.small, alternate=True)
            self.launches[2] += phases.cases([run], 2, 1, self.small, timed=False, alternate=True, floor=True)

    def timeline(self, run: int) -> None:
        if run == 0:
            for schedule, m in [("GPipe", 4), ("1F1B", 8), ("Interleaved1F1B", 8), ("ZBVZeroBubble", 8)]:
                if self.args.quick and schedule not in self.schedules:
                    continue
                case = self.add(2, "timeline", self.big, "timeline", run, schedule=schedule, microbatches=m)
                case.update(steps=max(case["steps"], 3), dirpath=str(self.out / "timeline" / f"{schedule}-M{m}"))
                case["trace_steps"] = 3
        # Recording cost: the small network, where a step is shortest, with and without the timeline.
        case = self.add(2, "timeline", self.small, "timeline_cost", run, schedule="1F1B", microbatches=4)
        case.update(dirpath=str(self.out / "timeline" / f"cost-{run}"), trace_steps=1)
        self.add(2, "strategy", self.small, "timeline_cost", run, schedule="1F1B", microbatches=4)


def _ordered(pair: tuple, run: int) -> tuple:
    return pair if run % 2 == 0 else pair[::-1]


def write_phases(results: dict[str, Any], args: argparse.Namespace) -> None:
    """The phases suite's section of the docs (its own generated block)."""
    if results.get("phases"):
        steps = (1, 1) if args.quick else (phases.STEPS, phases.WARMUP)
        block = phases.markdown(results["phases"], *steps)
        report.write_section(args.docs, block, phases.BEGIN, phases.END)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="every code path once, tiny model (CI smoke)")
    parser.add_argument("--runs", type=int, default=None, help="runs per case (default 5; 1 with --quick)")
    parser.add_argument("--suites", nargs="+", choices=SUITES, default=SUITES)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--docs", type=Path, default=None, help="page to update (default docs/benchmarks.md; '-': none, as --quick)"
    )
    parser.add_argument("--img", type=Path, default=None, help="plots (default docs/img/benchmarks; --quick: OUT/img)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per launch")
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the docs and plots from OUT/results.json, run nothing"
    )
    args = parser.parse_args()
    args.runs = args.runs or (1 if args.quick else 5)
    if args.docs is None:
        args.docs = Path("-") if args.quick else ROOT / "docs" / "benchmarks.md"
    if args.img is None:
        args.img = args.out / "img" if args.quick else ROOT / "docs" / "img" / "benchmarks"
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if args.report_only:
        previous = json.loads((args.out / "results.json").read_text())
        args.quick, args.runs = previous["quick"], previous["runs"]
        results = report.collect(previous["records"], args, previous["elapsed_s"])
        results["date"] = previous["date"]
        if "phases" in previous:
            results["phases"] = phases.summarize(previous["records"])
    else:
        cases = Plan(args, args.out).launches
        records: list[dict[str, Any]] = []
        for nprocs in (2, 1):
            if cases[nprocs]:
                records += launch(nprocs, cases[nprocs], args.out, args.timeout)
        results = report.collect(records, args, time.perf_counter() - start)
        if "phases" in args.suites:
            results["phases"] = phases.summarize(records)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    args.img.mkdir(parents=True, exist_ok=True)
    images = report.plots(results, args.img)
    for chart in results.get("timeline", {}).get("charts", []):
        target = args.img / f"timeline-{Path(chart).parent.name}.png"
        if Path(chart).exists():
            shutil.copyfile(chart, target)
        if target.exists():
            images.append(target)
    if str(args.docs) != "-":
        report.write_docs(results, args.docs, images)
        write_phases(results, args)
    print(report.summary(results))
    print(f"results: {args.out / 'results.json'}; {time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
