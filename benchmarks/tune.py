"""The tuner against an exhaustive sweep of the same candidates, and compiled stages against eager ones.

    python benchmarks/tune.py            # the full run (see docs/benchmarks.md for its duration), rewrites its section
    python benchmarks/tune.py --quick    # every code path once on tiny workloads, docs untouched (CI smoke)
    python benchmarks/tune.py --layouts  # the same with the layout searched: pipeline x data parallelism, or neither

On each workload of benchmarks/tune_models.py (2 processes, 1 thread each, each pinned to a core of its own unless
``--no-pin``, a fresh pair of processes per run and workload; ``--quick``: one pair per run), run by run
(``--runs``), interleaved so that a slower moment of the machine hits every case alike:

- **sweep**: every candidate of the search space (the tuner's default space: all seven schedules, the microbatch
  counts from 2 to 16 that divide the batch, 2 stages per rank for the multi-stage schedules, with and without
  activation checkpointing), each a fresh Trainer and model for ``warmup + steps`` steps, in a shuffled order;
- **tune**: ``lightning_pipe.tune`` on a fresh Trainer and model with the same space (``retune=True``): its choice,
  its own wall and CPU time, its table;
- **compile** (``mlp``, ``gpt``; ``--quick``: ``mlp``): 1F1B with ``compile=True`` against eager, and the first
  step's time (compilation).

With ``--layouts`` (default workloads ``small``, ``gpt``, ``gpt-vocab``), the space also holds the layout
(``pipeline_sizes="auto"``, ``data_parallel=("ddp", "fsdp")``: at 2 processes a 2-stage pipeline, or no pipeline
with DDP or FSDP over both) under four schedules (GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble) without activation
checkpointing; a sweep case with 2 replicas trains on half the batch per replica (the global batch kept, as the
tuner keeps it); no compiled cases. Its section of the docs is its own.

The report takes medians over runs of each run's median step time. Per workload: the sweep's best candidate, each
tuner run's choice and where it lands in the sweep (its sweep median over the best), and the tuning's cost in
"sweeps' worth of steps" (the tuner's wall time, over the sum of one median step of every candidate: the processes
already run when it starts, as they would in a script that tunes and then fits).

Results: ``--out`` (default benchmarks/results/tune) gets ``results.json`` and the worker log; ``--docs`` (default
docs/benchmarks.md) gets its generated section. ``--merge DIR DIR ...`` reports complete earlier outputs, batches
taken at different times, as one set of runs (the machine drifts between batches more than within one)::

    python benchmarks/tune.py --out /tmp/a && python benchmarks/tune.py --out /tmp/b --no-compile
    python benchmarks/tune.py --merge /tmp/a /tmp/b     # writes benchmarks/results/tune/results.json and the docs
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.tune_errors import _cell, _label, model_errors, model_inputs, model_lines, sureness_lines  # noqa: E402

MARKERS = {
    False: ("<!-- benchmarks/tune.py: begin (generated, do not edit by hand) -->", "<!-- benchmarks/tune.py: end -->"),
    True: (
        "<!-- benchmarks/tune.py --layouts: begin (generated, do not edit by hand) -->",
        "<!-- benchmarks/tune.py --layouts: end -->",
    ),
}
BEGIN, END = MARKERS[False]
#: batch size per pipeline and blocks of each workload (full, quick)
SHAPES = {
    "mlp": ((512, 8), (32, 8)),
    "gpt": ((16, 4), (8, 4)),
    "gpt-vocab": ((16, 4), (8, 4)),
    "small": ((64, 4), (32, 8)),
    "wide": ((16, 6), (32, 8)),
    "deep": ((32, 16), (32, 8)),
}
COMPILED = ("mlp", "gpt")
#: the workloads of a run without ``--workloads`` (without and with ``--layouts``)
DEFAULT_WORKLOADS = {False: ("mlp", "gpt", "gpt-vocab"), True: ("small", "gpt", "gpt-vocab")}
#: the schedules of the layout run (the single-stage, interleaved and V-shaped families, one zero-bubble)
LAYOUT_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")


def space(quick: bool, layouts: bool = False, schedules: Any = None, microbatches: Any = None) -> Any:
    from lightning_pipe import SearchSpace

    if layouts:
        return SearchSpace(
            schedules=tuple(schedules or (("1F1B",) if quick else LAYOUT_SCHEDULES)),
            microbatches=tuple(microbatches or ((1, 2) if quick else ())) or "auto",
            activation_checkpointing=(0,),
            pipeline_sizes="auto",
            data_parallel=("ddp", "fsdp"),
        )
    if quick:
        return SearchSpace(schedules=("1F1B", "ZBVZeroBubble"), microbatches=(2, 4), activation_checkpointing=(0,))
    return SearchSpace()


def sweep_candidates(args: argparse.Namespace, batch: int, blocks: int) -> list[tuple[dict[str, Any], int | None]]:
    """Every candidate of the space at 2 processes, with the per-replica batch it trains on (``None``: the
    workload's own, one replica). With ``--layouts``, every layout's candidates, as the tuner lists them."""
    from lightning_pipe.tune.layout import ProcessLayout, layouts
    from lightning_pipe.tune.space import candidates

    found = space(args.quick, args.layouts, getattr(args, "schedules", None), getattr(args, "microbatches", None))
    if not args.layouts:
        return [(c.settings(), None) for c in candidates(found, 2, batch, blocks)]
    out = []
    for layout in layouts(found, 2, ProcessLayout(2, 1), batch)[0]:
        replica = batch // layout.data_parallel_size
        for c in candidates(found, layout.pipeline_size, replica, blocks, layout):
            out.append((c.settings(), replica if layout.data_parallel_size > 1 else None))
    return out


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    cases = []
    for run in range(args.runs):
        order = random.Random(run)
        for workload in args.workloads:
            batch, blocks = SHAPES[workload][1 if args.quick else 0]
            found = sweep_candidates(args, batch, blocks)
            order.shuffle(found)
            found = [] if args.only_tune else found
            cases += [
                {"kind": "sweep", "workload": workload, "run": run, "settings": s, "batch_size": b} for s, b in found
            ]
            cases.append({"kind": "tune", "workload": workload, "run": run})
            compiled = COMPILED[:1] if args.quick else COMPILED
            if workload in compiled and not (args.no_compile or args.layouts):
                for compiled in order.sample([False, True], 2):
                    settings = {"schedule": "1F1B", "microbatches": 4, "compile": compiled}
                    cases.append({"kind": "compile", "workload": workload, "run": run, "settings": settings})
    return cases


# ------------------------------------------------------------------------------------------------------ the worker
def work(cases_file: Path, results_file: Path, args: argparse.Namespace, steps: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist

    import lightning_pipe
    from benchmarks.common import machine, pin_to_core, proc_status_bytes
    from benchmarks.lit import StepClock, trainer
    from benchmarks.tune_models import build
    from lightning_pipe.tune.layout import find_batch_knob

    # Before the process group starts its threads, which inherit the core.
    quick, layouts = args.quick, args.layouts
    core = pin_to_core(int(os.environ["LOCAL_RANK"])) if not args.no_pin else None
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0 and not (results_file.exists() and results_file.stat().st_size):
        with results_file.open("a") as f:
            f.write(json.dumps({"machine": {**machine(), "pinned": core is not None}}) + "\n")

    for case in json.loads(cases_file.read_text()):
        model, fit_kwargs = build(case["workload"], quick, batches=64)
        record: dict[str, Any] = {"case": case}
        if case["kind"] in ("sweep", "compile"):
            if case.get("batch_size"):  # more replicas: the global batch kept, as the tuner keeps it
                find_batch_knob(model, fit_kwargs.get("datamodule")).set(case["batch_size"])
            clock = StepClock()
            strategy = lightning_pipe.PipelineParallelStrategy(**case["settings"])
            trainer(strategy, 2, warmup + steps, [clock]).fit(model, **fit_kwargs)
            walls = clock.clock.wall
            cpus = [[(b - a) / 1e6 for a, b in zip(c, c[1:])] for c in _gather(clock.clock.cpu)]
            record["ms"] = [(b - a) / 1e6 for a, b in zip(walls, walls[1:])]
            record["cpu_ms"] = [sum(step) for step in zip(*cpus)]
        else:
            path = results_file.parent / f"tune-{case['workload']}-{case['run']}"
            searched = space(quick, layouts, args.schedules, args.microbatches)
            with model_inputs(path.with_suffix(".model.pkl") if rank == 0 else None):
                result = lightning_pipe.tune(
                    trainer("pipeline", 2, 1, []), model, space=searched, steps=steps, warmup_steps=warmup,
                    path=path, retune=True, **fit_kwargs,
                )  # fmt: skip
            record.update(choice=result.choice.settings(), label=result.choice.label, cost=result.cost)
            record["sureness"] = result.sureness
            record["table"] = result.table
        del model, fit_kwargs
        # A finished Trainer and its model are reference cycles: collected now, not when the collector's thresholds
        # say (left to them, the worker grew to 12 GB after ~200 Trainers and was killed for memory).
        gc.collect()
        record["rss_mib"] = proc_status_bytes("VmRSS") // 2**20
        if rank == 0:
            with results_file.open("a") as f:
                f.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


def _gather(stamps: list[int]) -> list[list[int]]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, stamps)
    return out


# ------------------------------------------------------------------------------------------------------ the report
def _median_run(ms: list[float], warmup: int) -> float:
    return statistics.median(ms[warmup:] or ms)


def collect(records: list[dict[str, Any]], warmup: int, files: Path | None = None) -> dict[str, Any]:
    """Per workload: every candidate's median step over runs, the best, each tuner run's choice and cost."""
    machine = next((r["machine"] for r in records if "machine" in r), {})
    out: dict[str, Any] = {"machine": machine, "workloads": {}}
    for workload in dict.fromkeys(r["case"]["workload"] for r in records if "case" in r):
        mine = [r for r in records if r.get("case", {}).get("workload") == workload]
        sweep: dict[str, list[float]] = {}
        per_run: dict[int, dict[str, float]] = {}
        labels: dict[str, dict[str, Any]] = {}
        for r in (r for r in mine if r["case"]["kind"] == "sweep"):
            key = json.dumps(r["case"]["settings"], sort_keys=True)
            ms = _median_run(r["ms"], warmup)
            sweep.setdefault(key, []).append(ms)
            per_run.setdefault(r["case"]["run"], {})[key] = ms
            labels[key] = r["case"]["settings"]
        medians = {k: statistics.median(v) for k, v in sweep.items()}
        best = min(medians, key=medians.get) if medians else None
        # The noise floor: each run's own sweep as a chooser that measured every candidate once, judged like the
        # tuner (its pick's median over runs, over the best's); and how far one candidate's runs lie apart.
        sweep_picks = []
        for run in sorted(per_run):
            pick = min(per_run[run], key=per_run[run].get)
            sweep_picks.append({"run": run, "label": _label(labels[pick]), "ratio": medians[pick] / medians[best]})
        spreads = [max(v) / min(v) for v in sweep.values() if len(v) > 1]
        tunes = []
        one_sweep = sum(medians.values()) / 1e3
        for r in (r for r in mine if r["case"]["kind"] == "tune"):
            key = json.dumps(r["choice"], sort_keys=True)
            # The worker's processes exist before `tune` runs: all of its wall time is the tuning's own.
            spent = r["cost"]["wall_s"]
            tunes.append(
                {
                    "run": r["case"]["run"],
                    "label": r["label"],
                    "ratio": medians[key] / medians[best] if key in medians and best else None,
                    "wall_s": r["cost"]["wall_s"],
                    "launch_s": r["cost"]["launch_s"],
                    "cpu_s": r["cost"]["cpu_s"],
                    "trials": r["cost"]["trials"],
                    "sweeps": spent / one_sweep if one_sweep else None,
                    "table": r["table"],
                    "sureness": r.get("sureness", {}),
                }
            )
        compiled = {}
        for flag in (False, True):
            runs = [r for r in mine if r["case"]["kind"] == "compile" and r["case"]["settings"]["compile"] == flag]
            if runs:
                compiled[str(flag)] = {
                    "ms": statistics.median(_median_run(r["ms"], warmup) for r in runs),
                    "first_ms": statistics.median(r["ms"][0] for r in runs),
                }
        ranked = sorted(medians, key=medians.get)
        out["workloads"][workload] = {
            "candidates": len(medians),
            "best": labels.get(best),
            "top": [(labels[k], medians[k]) for k in ranked[:5]],
            "worst": (labels[ranked[-1]], medians[ranked[-1]]) if ranked else None,
            "one_sweep_s": one_sweep,
            "tunes": tunes,
            "sweep_picks": sweep_picks,
            "run_spread": statistics.median(spreads) if spreads else None,
            "compile": compiled,
            "model": model_errors(files, workload, per_run) if files is not None else [],
        }
    return out


def stopped_run(out: Path, warmup: int) -> dict[str, Any]:
    """The results of the runs a stopped worker completed (every case of the run recorded), from its files."""
    cases = json.loads((out / "cases.json").read_text())
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    planned = collections.Counter(case["run"] for case in cases)
    recorded = collections.Counter(r["case"]["run"] for r in records if "case" in r)
    done = [n for n in sorted(planned) if recorded[n] == planned[n]]
    results = collect([r for r in records if "machine" in r or r["case"]["run"] in done], warmup, out)
    started = time.localtime((out / "cases.json").stat().st_mtime)
    results.update(date=time.strftime("%Y-%m-%dT%H:%M:%S", started), elapsed_s=None, runs=(len(done), len(planned)))
    return results


def merged(outputs: list[Path], warmup: int) -> dict[str, Any]:
    """Complete runs of this benchmark taken at different times (each output directory a batch with its
    ``results.json`` and ``records.jsonl``) reported as one: each batch's runs numbered after the previous batch's."""
    records: list[dict[str, Any]] = []
    batches = []
    summary: dict[str, Any] = {}
    for out in outputs:
        summary = json.loads((out / "results.json").read_text())
        batch = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
        offset = sum(b["runs"] for b in batches)
        for r in batch:
            if "case" in r:
                records.append({**r, "case": {**r["case"], "run": r["case"]["run"] + offset}})
            elif not records:  # the first batch's machine (and its load as the benchmark started)
                records.append(r)
        runs = len({r["case"]["run"] for r in batch if "case" in r})
        batches.append({"date": summary["date"], "elapsed_s": summary.get("elapsed_s"), "runs": runs})
    results = collect(records, warmup)
    elapsed = [b["elapsed_s"] for b in batches]
    results.update(
        date=batches[-1]["date"],
        elapsed_s=None if None in elapsed else sum(elapsed),
        load_end=summary.get("load_end"),  # the last batch's
        batches=batches,
    )
    return results


def _duration(results: dict[str, Any]) -> str:
    if results.get("elapsed_s") is None:
        return "duration not recorded"
    return f"{results['elapsed_s']:.0f} s"


def markdown(results: dict[str, Any], args: argparse.Namespace) -> str:
    m = results["machine"]
    done, planned = results.get("runs") or (args.runs, args.runs)
    runs = f"{done} runs, interleaved" if done == planned else f"The worker was stopped after {done} of {planned} runs"
    if len(results.get("batches") or ()) > 1:
        dates = ", ".join(f"{b['runs']} run{'s' * (b['runs'] != 1)} ending {b['date']}" for b in results["batches"])
        total = sum(b["runs"] for b in results["batches"])
        runs = f"{total} runs in {len(results['batches'])} batches ({dates}), interleaved within each batch"
    layouts = bool(getattr(args, "layouts", False))
    begin, end = markers(args)
    workloads = list(getattr(args, "workloads", None) or DEFAULT_WORKLOADS[layouts])
    named = f" --workloads {' '.join(workloads)}" if workloads != list(DEFAULT_WORKLOADS[layouts]) else ""
    flags = " --quick" * bool(args.quick) + " --layouts" * layouts + named + _space_flags(args)
    lines = [
        begin,
        "",
        "### Results, the layout searched too" if layouts else "### Results",
        "",
        f"`python benchmarks/tune.py{flags}`, {results['date']}, {_duration(results)};"
        f" {m.get('cpu')}, {m.get('cpu_cores')} cores, torch {m.get('torch')};"
        f" {'each process pinned to a core of its own' if m.get('pinned') else 'the processes free to use every core'};"
        " load average at the start:"
        f" {', '.join(f'{x:.1f}' for x in m.get('load_average') or [])}, at the end (the worker's own threads"
        f" included): {', '.join(f'{x:.1f}' for x in results.get('load_end') or []) or 'not recorded'}. {runs};"
        " each figure the median over runs of a run's median step (wall clock, rank 0, warm-up steps excluded).",
        "",
        *_busy(results),
        "| workload | candidates | sweep's best (ms/step) | sweep's worst | tuner's choices (sweep ms / best) |"
        " tuning cost: s (CPU s), trials | in sweeps' worth of steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, w in results["workloads"].items():
        top = w["top"][0] if w["top"] else None
        worst = w["worst"]
        choices = "; ".join(f"{t['label']} ({t['ratio']:.3f})" if t["ratio"] else t["label"] for t in w["tunes"])
        top_cell = _cell(_label(top[0]) + f" ({top[1]:.1f})") if top else "-"
        worst_cell = _cell(_label(worst[0]) + f" ({worst[1]:.1f})") if worst else "-"
        cost = "; ".join(f"{t['wall_s']:.1f} ({t['cpu_s']:.1f}), {t['trials']:.0f}" for t in w["tunes"])
        sweeps = "; ".join(f"{t['sweeps']:.2f}" for t in w["tunes"] if t["sweeps"] is not None)
        lines.append(
            f"| {name} | {w['candidates']} | {top_cell} | {worst_cell} | {_cell(choices)} | {cost} | {sweeps} |"
        )
    lines += [
        "",
        "The noise floor: each run's own sweep as a chooser that measured every candidate once, judged the same way"
        " (its pick's median over runs, over the best's), and the run-to-run spread (the median over candidates of"
        " a candidate's slowest run over its fastest):",
        "",
        "| workload | one run's sweep picks (sweep ms / best) | run-to-run spread |",
        "|---|---|---|",
    ]
    for name, w in results["workloads"].items():
        picks = "; ".join(f"{p['label']} ({p['ratio']:.3f})" for p in w.get("sweep_picks") or [])
        spread = f"{w['run_spread']:.3f}" if w.get("run_spread") else "-"
        lines.append(f"| {name} | {_cell(picks) or '-'} | {spread} |")
    lines += ["", "The five fastest candidates of each sweep (ms per step):", ""]
    for name, w in results["workloads"].items():
        lines.append(f"- **{name}**: " + ", ".join(f"{_label(s)} {ms:.1f}" for s, ms in w["top"]))
    compiled = {n: w["compile"] for n, w in results["workloads"].items() if w["compile"]}
    if compiled:
        lines += ["", "Compiled blocks (`compile=True`) against eager, 1F1B with 4 microbatches:", ""]
        lines += [
            "| workload | eager ms/step | compiled ms/step | ratio | first step, compiled (ms) |",
            "|---|---|---|---|---|",
        ]
        for name, c in compiled.items():
            if "False" in c and "True" in c:
                ratio = c["True"]["ms"] / c["False"]["ms"]
                lines.append(
                    f"| {name} | {c['False']['ms']:.1f} | {c['True']['ms']:.1f} | {ratio:.3f} |"
                    f" {c['True']['first_ms']:.0f} |"
                )
    lines += sureness_lines(results) + model_lines(results)
    first = next((w["tunes"][0] for w in results["workloads"].values() if w["tunes"]), None)
    if first:
        lines += [
            "",
            "The table the tuner printed in its first run on the first workload:",
            "",
            "```text",
            first["table"],
            "```",
        ]
    lines += ["", end]
    return "\n".join(lines)


def _space_flags(args: argparse.Namespace) -> str:
    out = f" --schedules {' '.join(args.schedules)}" if getattr(args, "schedules", None) else ""
    return out + (
        f" --microbatches {' '.join(map(str, args.microbatches))}" if getattr(args, "microbatches", None) else ""
    )


def markers(args: argparse.Namespace) -> tuple[str, str]:
    """The generated section's markers: one per kind of run; a layout run of other workloads or another space has
    its own section."""
    layouts = bool(getattr(args, "layouts", False))
    default = list(DEFAULT_WORKLOADS[layouts])
    workloads = list(getattr(args, "workloads", None) or default)
    if not layouts or (workloads == default and not _space_flags(args)):
        return MARKERS[layouts]
    flags = f"--layouts --workloads {' '.join(workloads)}{_space_flags(args)}"
    return (
        f"<!-- benchmarks/tune.py {flags}: begin (generated, do not edit by hand) -->",
        f"<!-- benchmarks/tune.py {flags}: end -->",
    )


def _busy(results: dict[str, Any]) -> list[str]:
    """A warning when other jobs loaded the machine as the run started (a one-minute load average above its core
    count). The load at the end counts the worker's own threads (3.5-3.9 on 2 cores with nothing else running), so
    it says nothing about other jobs."""
    cores = results["machine"].get("cpu_cores") or 1
    load = (results["machine"].get("load_average") or [0.0])[0]
    if load <= cores:
        return []
    return [
        f"**The machine was shared with other jobs as this run started (load average {load:.1f} on {cores}"
        " cores): the step times carry their noise, and a comparison within 5% means little.**",
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="every code path once on tiny workloads (CI smoke)")
    parser.add_argument("--runs", type=int, default=None, help="runs per case (default 3; 1 with --quick)")
    parser.add_argument("--workloads", nargs="+", default=None, help="default: mlp gpt gpt-vocab (--layouts: small)")
    parser.add_argument(
        "--layouts", action="store_true", help="search the layout too (pipeline x data parallelism, or none)"
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled cases")
    parser.add_argument(
        "--no-pin", action="store_true", help="leave the worker processes free to run on every core (default: one each)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="default benchmarks/results/tune (--layouts: tune-layouts)"
    )
    parser.add_argument(
        "--docs", type=Path, default=None, help="page to update (default docs/benchmarks.md; '-': none)"
    )
    parser.add_argument("--timeout", type=float, default=7200)
    parser.add_argument("--report-only", action="store_true", help="rewrite the docs from OUT/results.json")
    parser.add_argument(
        "--from-records", action="store_true", help="report a stopped run from OUT/records.jsonl: its complete runs"
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        help="report these complete earlier outputs (results.json, records.jsonl) as one set of runs: OUT/results.json",
    )
    parser.add_argument("--schedules", nargs="+", default=None, help="--layouts: the schedules (default: four)")
    parser.add_argument("--microbatches", nargs="+", type=int, default=None, help="--layouts: the counts")
    parser.add_argument("--only-tune", action="store_true", help="no sweep: the tuner alone")
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.runs = args.runs or (1 if args.quick else 3)
    args.workloads = args.workloads or list(DEFAULT_WORKLOADS[bool(args.layouts)])
    args.out = args.out or ROOT / "benchmarks" / "results" / ("tune-layouts" if args.layouts else "tune")
    steps, warmup = (1, 1) if args.quick else (6, 2)
    if args.worker:
        return work(args.worker[0], args.worker[1], args, steps, warmup)
    if args.docs is None:
        args.docs = Path("-") if args.quick else ROOT / "docs" / "benchmarks.md"
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if args.merge:
        results = merged(args.merge, warmup)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    elif args.report_only:
        results = json.loads((args.out / "results.json").read_text())
    elif args.from_records:
        results = stopped_run(args.out, warmup)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    else:
        cases_file, records_file = args.out / "cases.json", args.out / "records.jsonl"
        cases = plan(args)
        cases_file.write_text(json.dumps(cases))
        records_file.unlink(missing_ok=True)
        (args.out / "worker.log").unlink(missing_ok=True)
        # A fresh pair of processes per run and workload, so that no workload inherits another's memory; the smoke
        # (`--quick`: figures that mean nothing, a launch that costs more than its cases) runs all of a run in one pair.
        chunks: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for case in cases:
            chunks.setdefault((case["run"], "all" if args.quick else case["workload"]), []).append(case)
        deadline = time.monotonic() + args.timeout
        for (run, workload), chunk in chunks.items():
            chunk_file = args.out / f"cases-{run}-{workload}.json"
            chunk_file.write_text(json.dumps(chunk))
            _run_worker(args, chunk_file, records_file, deadline - time.monotonic())
            chunk_file.unlink()
        records = [json.loads(line) for line in records_file.read_text().splitlines()]
        results = collect(records, warmup, args.out)
        results.update(date=time.strftime("%Y-%m-%dT%H:%M:%S"), elapsed_s=time.perf_counter() - start)
        results["load_end"] = list(os.getloadavg())
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = markdown(results, args)
    if str(args.docs) != "-":
        from benchmarks.report import write_section

        write_section(args.docs, text, *markers(args))
    print(text)


def _run_worker(args: argparse.Namespace, cases_file: Path, records_file: Path, timeout: float) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_port()}"]
    cmd += [__file__, "--worker", str(cases_file), str(records_file)] + (["--quick"] if args.quick else [])
    cmd += ["--no-pin"] if args.no_pin else []
    cmd += ["--layouts"] if args.layouts else []
    cmd += ["--schedules", *args.schedules] if args.schedules else []
    cmd += ["--microbatches", *map(str, args.microbatches)] if args.microbatches else []
    with (args.out / "worker.log").open("a") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=max(timeout, 1))
    if proc.returncode != 0:
        raise SystemExit(f"the worker failed ({proc.returncode}):\n{(args.out / 'worker.log').read_text()[-4000:]}")


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
