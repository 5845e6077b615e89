"""Where a step's time goes: the strategy and the hand-written loop it replaces, phase by phase.

    python benchmarks/phases.py                  # 8 rounds, ~4 minutes on 2 CPU cores; rewrites its docs section
    python benchmarks/phases.py --quick          # every code path once (CI smoke), docs untouched
    python benchmarks/phases.py --model compute  # the compute-bound ratio: 100 rounds, ~10 minutes; its docs block
    python benchmarks/phases.py --model small --alternate          # the loops alternating step by step (~8 min)
    python benchmarks/phases.py --model small --alternate --floor  # the same with Lightning driving the hand loop

The small network (4 x Linear(256) + ReLU, batch 64), 1F1B, 4 microbatches, 2 processes x 1 thread, each process
pinned to its own core (:func:`benchmarks.common.pin_to_core`). Every round runs four trainings in one launch, their
order reversed every other round: the hand loop and the strategy as they are (the headline: CPU and wall time per
step, and the strategy-minus-hand difference with its 95% confidence interval over the rounds), then both again with
every phase timed.

With ``--model compute`` (8 x Linear(1024), batch 512, 8 microbatches) the rounds train only the untimed pair and the
result is the compute-bound ratio, the strategy's wall time per step over the hand loop's, paired round by round: the
two trainings of a round run seconds apart in the same processes, so the machine's slower and faster minutes, which
make runs of separate launches differ by up to 2 to 1 on a shared 2-core machine, hit both alike.

Timing a phase: its entry points (torch's, Lightning's and the strategy's functions, listed in :data:`PHASES`) are
wrapped at the benchmark level, never in the library. Each wrapper reads the calling thread's CPU clock
(``time.thread_time_ns``) on entry and exit; time spent in a nested timed call is charged to the nested phase only,
so the phases add up to the step's main-thread CPU time. What no entry point covers is ``loop and hooks``: the hand
loop's own lines, or Lightning's loop, its hooks and the strategy's glue between the timed calls. ``communication
threads`` is the CPU time of the process's other threads (gloo runs its sends and receives there). Every figure is per
step, summed over the two processes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# What runs in the workers (benchmarks/phase_timing.py) and the targets (benchmarks/stats.py): read from here too.
from benchmarks.phase_timing import (  # noqa: E402, F401
    COMM,
    COMPUTE_PHASES,
    GRADS,
    LOOP,
    PHASES,
    THREADS,
    PhaseTimer,
    interleaved,
    load_average,
    phase_names,
    run_case,
    timed_phases,
)
from benchmarks.stats import FIXED_COST_TARGET_MS, RATIO_TARGET, ci, mean_ci, verdict  # noqa: E402

BEGIN = "<!-- benchmarks/phases.py: begin (generated, do not edit by hand) -->"
END = "<!-- benchmarks/phases.py: end -->"
RATIO_BEGIN = "<!-- benchmarks/phases.py --model compute: begin (generated, do not edit by hand) -->"
RATIO_END = "<!-- benchmarks/phases.py --model compute: end -->"


def alternate_markers(model: str, floor: bool = False) -> tuple[str, str]:
    """The generated block of ``--alternate`` runs of ``model`` (one per network, and one per network with
    ``--floor``)."""
    flag = f"--model {model} --alternate" + (" --floor" if floor else "")
    return (
        f"<!-- benchmarks/phases.py {flag}: begin (generated, do not edit by hand) -->",
        f"<!-- benchmarks/phases.py {flag}: end -->",
    )


NETWORKS = {
    "small": "Small network (4 x Linear(256) + ReLU, batch 64)",
    "compute": "Compute-bound network (8 x Linear(1024) + ReLU, batch 512)",
    "tiny": "Tiny network (the smoke run's)",
}
#: --alternate: rounds, measured steps and warm-up steps of each network's strategy training
ALTERNATE = {"small": (20, 300, 20), "compute": (20, 40, 3), "tiny": (1, 2, 1)}
#: --alternate: glibc's allocator keeps what it frees (no trimming, no memory map per tensor) in the workers. The two
#: loops share one heap there, and with glibc's defaults each one's allocations decided when the other's were handed
#: back to the OS and faulted in again: measured on the compute-bound network, the strategy's steps faulted ~3,500
#: pages a step back in against the hand loop's 200-400, and a change to the strategy's gradient lifetimes moved the
#: ratio from 1.037 to 1.001 with the defaults but from 1.015 to 1.020 (within noise) with these settings.
ALTERNATE_ENV = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}
SCHEDULE, MICROBATCHES = "1F1B", 4
ROUNDS, STEPS, WARMUP = 8, 150, 15
#: --model compute: microbatches (as benchmarks/run.py's compute-bound cases), rounds, steps and warm-up steps
COMPUTE_MICROBATCHES, COMPUTE_ROUNDS, COMPUTE_STEPS, COMPUTE_WARMUP = 8, 100, 8, 2
OUTSIDE = "everything but stage forward and backward"


# ---------------------------------------------------------------------------------------------------- the plan
def cases(
    rounds: list[int],
    steps: int,
    warmup: int,
    model: str,
    timed: bool = True,
    microbatches: int = MICROBATCHES,
    alternate: bool = False,
    floor: bool = False,
) -> list[dict[str, Any]]:
    """The four trainings of each round (two: the untimed ones, without ``timed``), in the order they run; with
    ``alternate``, one training in which the loops alternate step by step (and one more with every phase timed);
    ``floor``: in those, Lightning's loop driving the hand pipeline in place of the strategy."""
    out = []
    for r in rounds:
        order = [("hand", False), ("strategy", False), ("hand", True), ("strategy", True)][: 4 if timed else 2]
        if alternate:
            order = [("interleaved", False), ("interleaved", True)][: 2 if timed else 1]
        for of, phased in order if r % 2 == 0 else order[::-1]:
            case = {"kind": "phases", "of": of, "phased": phased, "model": model, "suite": "phases", "run": r}
            if alternate and floor:
                case["floor"] = True
            case.update(steps=steps, warmup=warmup, schedule=SCHEDULE, microbatches=microbatches, pin=True)
            out.append(case)
    return out


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per round and training: median CPU and wall time per step, median of each phase; across rounds: the means
    with their confidence intervals, and the strategy-minus-hand differences and strategy/hand ratios paired round
    by round. The alternating trainings (``--alternate``) under ``alternating``, those with Lightning driving the hand
    loop (``--floor``) under ``floor``."""
    machine = next((rec["machine"] for rec in records if "machine" in rec), None)
    timings = [rec for rec in records if rec.get("case", {}).get("suite") == "phases" and "error" not in rec]
    alternating = [rec for rec in timings if rec["case"]["of"] == "interleaved" and not rec["case"].get("floor")]
    floor = [rec for rec in timings if rec["case"]["of"] == "interleaved" and rec["case"].get("floor")]
    per: dict[tuple[int, str, bool], dict[str, Any]] = {}
    for rec in timings:
        c = rec["case"]
        if c["of"] == "interleaved":
            continue
        row = {"cpu": statistics.median(rec["cpu_ms"]), "wall": statistics.median(rec["ms"]), "load": rec.get("load")}
        if rec.get("phases"):
            row["phases"] = {k: statistics.median(s[k] for s in rec["phases"]) for k in phase_names()}
            row["phase_sum"] = statistics.median(sum(s.values()) for s in rec["phases"])
        per[(c["run"], c["of"], c["phased"])] = row
    load = [rec["load"] for rec in timings if rec.get("load") is not None]
    rounds = sorted({r for r, _, _ in per})
    out: dict[str, Any] = {"machine": machine, "rounds": len(rounds), "load": load}
    if alternating:
        out["alternating"] = _alternating(alternating)
    if floor:  # Lightning's loop driving the hand loop, alternating with the hand loop (--alternate --floor)
        out["floor"] = _alternating(floor)
    if (alternating or floor) and not per:
        return out
    for field in ("cpu", "wall"):
        for of in ("hand", "strategy"):
            out[f"{of}_{field}"] = mean_ci([per[(r, of, False)][field] for r in rounds if (r, of, False) in per])
        paired = [r for r in rounds if (r, "hand", False) in per and (r, "strategy", False) in per]
        diffs = [per[(r, "strategy", False)][field] - per[(r, "hand", False)][field] for r in paired]
        out[f"diff_{field}"] = mean_ci(diffs) if diffs else None
        ratios = [per[(r, "strategy", False)][field] / per[(r, "hand", False)][field] for r in paired]
        out[f"ratio_{field}"] = mean_ci(ratios) if ratios else None
    # the rounds in which both phase-timed trainings ran: the table's differences and the outside row pair them
    timed_pairs = [r for r in rounds if all("phases" in per.get((r, of, True), {}) for of in ("hand", "strategy"))]
    table = []
    for name in phase_names():
        entry: dict[str, Any] = {"phase": name}
        for of in ("hand", "strategy"):
            values = [per[(r, of, True)]["phases"][name] for r in rounds if "phases" in per.get((r, of, True), {})]
            entry[of] = mean_ci(values) if values else None
        diffs = [
            per[(r, "strategy", True)]["phases"][name] - per[(r, "hand", True)]["phases"][name] for r in timed_pairs
        ]
        entry["diff"] = mean_ci(diffs) if diffs else None
        table.append(entry)
    out["table"] = table
    # What the strategy adds outside the network's compute, round by round: its own share of the step, free of the
    # compute phases' noise (they run the same torch code in both loops, and dominate a compute-bound step).
    outside = {of: [_outside(per[(r, of, True)]["phases"]) for r in timed_pairs] for of in ("hand", "strategy")}
    extra = [s - h for h, s in zip(outside["hand"], outside["strategy"])]
    out["outside"] = {of: mean_ci(v) if v else None for of, v in outside.items()}
    out["outside"]["diff"] = mean_ci(extra) if extra else None
    shares = [e / per[(r, "hand", True)]["phase_sum"] for e, r in zip(extra, timed_pairs)]
    out["outside"]["share"] = mean_ci(shares) if shares else None
    for of in ("hand", "strategy"):
        timed = [r for r in rounds if (r, of, True) in per and (r, of, False) in per]
        out[f"{of}_timed_cpu"] = mean_ci([per[(r, of, True)]["cpu"] for r in timed]) if timed else None
    return out


def _alternating(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The interleaved trainings: per round, the median of each loop's steps and the median of the step-by-step
    differences and ratios (each strategy step against the hand step just before it); across rounds, their means
    with confidence intervals. ``spread``: the standard deviation of a step pair's ratio within a round (the mean
    over the rounds), what pairing step by step leaves of the machine's noise. The phase-timed trainings give the
    phase table (each phase's median per round and loop; the difference paired round by round)."""
    untimed = [rec for rec in records if not rec["case"]["phased"]]
    out: dict[str, Any] = {"rounds": len(untimed)}
    spreads = []
    for field, key in (("wall", "steps_ms"), ("cpu", "steps_cpu_ms")):
        rows: dict[str, list[float]] = {"hand": [], "strategy": [], "diff": [], "ratio": []}
        for rec in untimed:
            hand, strategy = rec[key]["hand"], rec[key]["strategy"]
            ratios = [s / h for h, s in zip(hand, strategy)]
            rows["hand"].append(statistics.median(hand))
            rows["strategy"].append(statistics.median(strategy))
            rows["diff"].append(statistics.median(s - h for h, s in zip(hand, strategy)))
            rows["ratio"].append(statistics.median(ratios))
            if field == "wall" and len(ratios) > 1:
                spreads.append(statistics.stdev(ratios))
        out.update({f"{k}_{field}": mean_ci(v) if v else None for k, v in rows.items()})
    out["spread"] = statistics.fmean(spreads) if spreads else math.nan
    out["steps"] = statistics.median(len(rec["steps_ms"]["hand"]) for rec in untimed) if untimed else 0
    timed = [rec for rec in records if rec["case"]["phased"] and rec["phases"]["hand"]]
    if timed:
        out.update(_alternating_phases(timed))
    return out


def _alternating_phases(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The phase table of the phase-timed interleaved trainings, in the shape of :func:`summarize`'s."""
    per = {of: [rec["phases"][of] for rec in records] for of in ("hand", "strategy")}

    def medians(of: str, value: Callable[[dict[str, float]], float]) -> list[float]:
        return [statistics.median(value(step) for step in steps) for steps in per[of]]

    table = []
    for name in phase_names():
        hand, strategy = medians("hand", lambda st, k=name: st[k]), medians("strategy", lambda st, k=name: st[k])
        diff = mean_ci([s - h for h, s in zip(hand, strategy)])
        table.append({"phase": name, "hand": mean_ci(hand), "strategy": mean_ci(strategy), "diff": diff})
    hand_out, strategy_out = medians("hand", _outside), medians("strategy", _outside)
    hand_sum, strategy_sum = (
        medians("hand", lambda st: sum(st.values())),
        medians("strategy", lambda st: sum(st.values())),
    )
    extra = [s - h for h, s in zip(hand_out, strategy_out)]
    outside = {"hand": mean_ci(hand_out), "strategy": mean_ci(strategy_out), "diff": mean_ci(extra)}
    outside["share"] = mean_ci([e / h for e, h in zip(extra, hand_sum)])
    return {
        "table": table,
        "outside": outside,
        "hand_timed_cpu": mean_ci(hand_sum),
        "strategy_timed_cpu": mean_ci(strategy_sum),
        "phased_rounds": len(records),
    }


def _outside(phases: dict[str, float]) -> float:
    return sum(v for k, v in phases.items() if k not in COMPUTE_PHASES)


def _machine_line(summary: dict[str, Any]) -> str:
    m = summary.get("machine") or {}
    load = summary.get("load") or []
    load_text = f"{min(load):.2f}-{max(load):.2f}" if load else "n/a"
    return (
        f"{m.get('cpu', '?')}, {m.get('cpu_cores', '?')} cores, torch {m.get('torch', '?')}, Lightning"
        f" {m.get('lightning', '?')}; load average (1 min) during the rounds {load_text}"
    )


def markdown(summary: dict[str, Any], steps: int, warmup: int) -> str:
    lines = [
        BEGIN,
        "",
        f"Small network (4 x Linear(256) + ReLU, batch 64), {SCHEDULE}, {MICROBATCHES} microbatches, 2 processes x 1"
        f" thread pinned to one core each; {summary['rounds']} rounds of {steps} steps after {warmup}"
        f" warm-up steps, the trainings of a round interleaved (order reversed every other round);"
        f" {_machine_line(summary)}. Each figure: the mean over the rounds of each round's median"
        " step, [95% confidence interval over the rounds]; ms per step, summed over both processes (CPU) or on rank"
        " 0 (wall).",
        "",
        "| per step | hand-written loop | strategy | strategy - hand |",
        "|---|---|---|---|",
        f"| CPU time, ms | {ci(summary['hand_cpu'])} | {ci(summary['strategy_cpu'])} | {ci(summary['diff_cpu'])} |",
        f"| wall time, ms | {ci(summary['hand_wall'])} | {ci(summary['strategy_wall'])} | {ci(summary['diff_wall'])} |",
        "",
        *_phase_table(summary),
        "",
        END,
    ]
    return "\n".join(lines)


def _phase_table(summary: dict[str, Any], other: str = "strategy") -> list[str]:
    lines = [
        "Phase by phase (the same trainings again with every phase timed; CPU ms per step, both processes):",
        "",
        f"| phase | hand-written loop | {other} | {other} - hand |",
        "|---|---|---|---|",
    ]
    for row in summary["table"]:
        lines.append(f"| {row['phase']} | {ci(row['hand'])} | {ci(row['strategy'])} | {ci(row['diff'])} |")
    outside = summary["outside"]
    lines.append(f"| {OUTSIDE} | {ci(outside['hand'])} | {ci(outside['strategy'])} | {ci(outside['diff'])} |")
    hand, strategy = ci(summary["hand_timed_cpu"]), ci(summary["strategy_timed_cpu"])
    lines.append(f"| all phases timed (timers included) | {hand} | {strategy} | |")
    return lines


def ratio_markdown(summary: dict[str, Any], steps: int, warmup: int, microbatches: int) -> str:
    """The ``--model compute`` block: the compute-bound ratio with its confidence interval."""
    ratio = summary["ratio_wall"]
    lines = [
        RATIO_BEGIN,
        "",
        f"Compute-bound network (8 x Linear(1024) + ReLU, batch 512), {SCHEDULE}, {microbatches} microbatches, 2"
        f" processes x 1 thread pinned to one core each; {summary['rounds']} rounds, each the hand loop and the"
        f" strategy for {steps} steps after {warmup} warm-up steps in the same launch (order reversed every other"
        f" round); {_machine_line(summary)}. Each figure: the mean over the rounds of each round's median step on"
        " rank 0, [95% confidence interval over the rounds]; the ratio is paired round by round.",
        "",
        "| per step | hand-written loop | strategy | strategy / hand |",
        "|---|---|---|---|",
        f"| wall time, ms | {ci(summary['hand_wall'], 1)} | {ci(summary['strategy_wall'], 1)} | {ci(ratio, 3)} |",
        f"| CPU time, ms (both processes) | {ci(summary['hand_cpu'], 1)} | {ci(summary['strategy_cpu'], 1)}"
        f" | {ci(summary['ratio_cpu'], 3)} |",
        "",
        f"Target (compute-bound ratio at most {RATIO_TARGET}): {verdict(ratio)}",
        "",
    ]
    share = summary["outside"]["share"]
    if share is not None:
        lines += [*_phase_table(summary), ""]
        lines.append(
            f"Outside the stages' forward and backward the strategy adds {ci(summary['outside']['diff'])} ms of CPU"
            f" per step, {ci({k: 100 * v if k != 'n' else v for k, v in share.items()}, 2)}% of the hand loop's"
            " timed step."
        )
        lines.append("")
    lines.append(RATIO_END)
    return "\n".join(lines)


def alternate_markdown(summary: dict[str, Any], model: str, warmup: int, microbatches: int, floor: bool = False) -> str:
    """The ``--alternate`` block: the two loops alternating step by step, their difference and ratio (``floor``: the
    hand loop against Lightning's loop driving the hand loop, Lightning's share of the fixed cost)."""
    alt = summary["floor" if floor else "alternating"]
    begin, end = alternate_markers(model, floor)
    other = "Lightning + hand" if floor else "strategy"

    def row(name: str, field: str, digits: int) -> str:
        cells = [ci(alt[f"{k}_{field}"], digits) for k in ("hand", "strategy", "diff")]
        return f"| {name} | {' | '.join(cells)} | {ci(alt[f'ratio_{field}'], 3)} |"

    if floor and model == "compute":
        target = (
            f"Lightning's share of the compute-bound ratio: {ci(alt['ratio_wall'], 3)} of wall clock"
            f" ({ci(alt['diff_wall'])} ms per step); the rest of the strategy's ratio is its own."
        )
    elif floor:
        target = (
            f"Lightning's share of the strategy's fixed cost: {ci(alt['diff_wall'])} ms of wall clock and"
            f" {ci(alt['diff_cpu'])} ms of CPU per step; the rest is the strategy's own."
        )
    elif model == "small":
        fixed = verdict(alt["diff_wall"], FIXED_COST_TARGET_MS, " ms")
        target = f"Target (fixed cost at most {FIXED_COST_TARGET_MS} ms): {fixed}"
    else:
        target = f"Target (compute-bound ratio at most {RATIO_TARGET}): {verdict(alt['ratio_wall'])}"
    training = (
        "Lightning training that drives a second hand-written pipeline (benchmarks/lit.py `HandModule`: its"
        " `training_step` keeps the batch, its `backward` runs the torch schedule, Lightning steps the optimizer;"
        " Lightning's `DDPStrategy` without the DDP wrapper) for"
        if floor
        else "strategy training of"
    )
    whose, paired = ("its", "Lightning") if floor else ("the strategy's", "strategy")
    lines = [
        begin,
        "",
        f"{NETWORKS[model]}, {SCHEDULE}, {microbatches} microbatches, 2 processes x 1 thread pinned to one core each;"
        f" {alt['rounds']} rounds, each one {training} {alt['steps']:.0f} measured steps after {warmup}"
        " warm-up steps in which a callback runs one step of the hand-written loop (its own network, stages,"
        f" schedule, optimizer and DataLoader) as each of {whose} steps starts, so that the two loops alternate step"
        f" by step; {_machine_line(summary)}. Each {paired} step is paired with the hand step just before it. Each"
        " figure: the mean over the rounds of each round's median, [95% confidence interval over the rounds]; wall"
        " time on rank 0, CPU time summed over both processes. Within a round a step pair's"
        f" ratio varies by {100 * alt['spread']:.1f}% (standard deviation).",
        "",
        f"| per step | hand-written loop | {other} | {other} - hand | {other} / hand |",
        "|---|---|---|---|---|",
        row("wall time, ms", "wall", 2),
        row("CPU time, ms (both processes)", "cpu", 2),
        "",
        target,
        "",
    ]
    if "table" in alt:
        lines += [*_phase_table(alt, other), ""]
        lines.append(
            f"Phase by phase: {alt['phased_rounds']} more rounds, every phase timed. Outside the stages' forward and"
            f" backward {'Lightning' if floor else 'the strategy'} adds {ci(alt['outside']['diff'])} ms of CPU per"
            " step,"
            f" {ci({k: 100 * v if k != 'n' else v for k, v in alt['outside']['share'].items()}, 2)}% of the hand"
            " loop's timed step."
        )
        lines.append("")
    lines.append(end)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round of 2 steps, tiny network (CI smoke)")
    parser.add_argument(
        "--model",
        choices=("small", "compute"),
        default="small",
        help="small: the fixed cost phase by phase; compute: the compute-bound ratio (untimed pairs only)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 8, compute 100; 1 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per training (default 150, compute 8)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per training (default 15, compute 2)")
    parser.add_argument("--untimed", action="store_true", help="only the untimed trainings (to compare versions)")
    parser.add_argument("--phased", action="store_true", help="--model compute: the phase-timed trainings too")
    parser.add_argument(
        "--alternate",
        action="store_true",
        help="the two loops alternating step by step in one training a round (default 20 rounds; small: 300 steps"
        " after 20, compute: 40 after 3)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="with --alternate: Lightning's loop driving the hand loop in place of the strategy (Lightning's share)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "phases")
    parser.add_argument("--docs", type=Path, default=None, help="page to update ('-': none)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the launch")
    args = parser.parse_args(argv)
    if args.floor and not args.alternate:
        parser.error("--floor measures Lightning's share by alternating the loops step by step: add --alternate")
    compute = args.model == "compute"
    model = "tiny" if args.quick else args.model
    if args.alternate:
        rounds, steps, warmup = ALTERNATE[model]
        args.rounds, args.steps, args.warmup = args.rounds or rounds, args.steps or steps, args.warmup or warmup
    args.rounds = args.rounds or (1 if args.quick else COMPUTE_ROUNDS if compute else ROUNDS)
    args.steps = args.steps or (2 if args.quick else COMPUTE_STEPS if compute else STEPS)
    args.warmup = args.warmup or (1 if args.quick else COMPUTE_WARMUP if compute else WARMUP)
    if args.docs is None:
        args.docs = Path("-") if args.quick else ROOT / "docs" / "benchmarks.md"
    if args.out == ROOT / "benchmarks" / "results" / "phases":
        if args.alternate:
            args.out = ROOT / "benchmarks" / "results" / f"alternate_{'floor_' if args.floor else ''}{args.model}"
        elif compute:
            args.out = ROOT / "benchmarks" / "results" / "compute_ratio"
    args.out.mkdir(parents=True, exist_ok=True)
    from benchmarks import report
    from benchmarks.common import launch

    micro = COMPUTE_MICROBATCHES if compute else MICROBATCHES
    timed = args.phased if compute else not args.untimed
    rounds = list(range(args.rounds))
    plan = cases(rounds, args.steps, args.warmup, model, timed, micro, alternate=args.alternate, floor=args.floor)
    records = launch(2, plan, args.out, args.timeout, ALTERNATE_ENV if args.alternate else None)
    summary = summarize(records)
    # (the phase-timed steps of --alternate, one dict per step, stay in results-2.jsonl: megabytes)
    kept = [{k: v for k, v in r.items() if k != "phases"} for r in records] if args.alternate else records
    (args.out / "phases.json").write_text(json.dumps({"summary": summary, "records": kept}, indent=1))
    if args.alternate:
        text = alternate_markdown(summary, model, args.warmup, micro, args.floor)
        markers = alternate_markers(model, args.floor)
    elif compute:
        text, markers = ratio_markdown(summary, args.steps, args.warmup, micro), (RATIO_BEGIN, RATIO_END)
    else:
        text, markers = markdown(summary, args.steps, args.warmup), (BEGIN, END)
    if str(args.docs) != "-":
        report.write_section(args.docs, text, *markers)
    print(text)
    return summary


if __name__ == "__main__":
    main()
