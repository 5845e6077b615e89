"""From the workers' records to the figures: statistics, tables, plots and the generated part of docs/benchmarks.md.

Every figure is a median over runs of a per-run median (the run's steps after its warm-up), with the spread as the
lowest and highest run. Ratios and differences are taken run by run (run ``r`` of the strategy against run ``r`` of
the hand loop, which ran next to it) and then summarised the same way.
"""

from __future__ import annotations

import datetime
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.stats import FIXED_COST_TARGET_MS, RATIO_TARGET, ci, mean_ci, verdict
from lightning_pipe.measure.timeline import ideal_speedup, theoretical_bubble

BEGIN = "<!-- benchmarks/run.py: begin (generated, do not edit by hand) -->"
END = "<!-- benchmarks/run.py: end -->"
STAGES_PER_RANK = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2}
K = 2  # processes per pipeline in every suite


def _key(case: dict[str, Any]) -> tuple:
    return (
        case["suite"],
        case["kind"],
        case["model"],
        case.get("schedule"),
        case.get("microbatches"),
        case.get("note"),
    )


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def collect(records: list[dict[str, Any]], args: Any, elapsed: float) -> dict[str, Any]:
    """Summaries of every suite (see the module docstring) plus the raw records."""
    machines = [r for r in records if "machine" in r]
    by_key: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r in records:
        if "case" in r and "ms" in r and r["ms"]:
            by_key[_key(r["case"])][r["case"]["run"]] = r
    results: dict[str, Any] = {
        "machine": machines[0]["machine"] if machines else {},
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "quick": bool(args.quick),
        "runs": args.runs,
        "elapsed_s": round(elapsed),
        "records": records,
    }
    stats = Stats(by_key)
    results["overhead"] = stats.overhead()
    results["speedup"] = stats.speedup()
    results["ddp"] = stats.ddp()
    results["eval"] = stats.evaluation()
    results["timeline"] = stats.timeline()
    return results


class Stats:
    def __init__(self, by_key: dict[tuple, dict[int, dict]]) -> None:
        self.by_key = by_key
        self.models = {k[2] for k in by_key}

    def runs(self, *key: Any, field: str = "ms") -> dict[int, float]:
        """Per run, the median step time of the case ``key`` (``_key`` order)."""
        return {run: statistics.median(r[field]) for run, r in self.by_key.get(tuple(key), {}).items()}

    def pair(self, a: dict[int, float], b: dict[int, float]) -> dict[str, Any] | None:
        """``b - a`` and ``b / a`` run by run."""
        runs = sorted(set(a) & set(b))
        if not runs:
            return None
        diffs, ratios = [b[r] - a[r] for r in runs], [b[r] / a[r] for r in runs]
        return {
            "a": spread([a[r] for r in runs]),
            "b": spread([b[r] for r in runs]),
            "diff": spread(diffs),
            "ratio": spread(ratios),
            # the mean with its 95% confidence interval over the runs (Student's t), paired run by run
            "diff_ci": mean_ci(diffs),
            "ratio_ci": mean_ci(ratios),
        }

    def overhead(self) -> dict[str, Any]:
        out: dict[str, Any] = {"small": [], "compute": []}
        small = "tiny" if "tiny" in self.models else "small"
        big = "tiny" if "tiny" in self.models else "compute"
        for schedule in STAGES_PER_RANK:
            for name, suite, model, m, strategy_suite in (
                ("small", "small", small, 4, "small"),
                ("compute", "overhead", big, 8, "speedup"),
            ):
                hand = self.runs(suite, "hand", model, schedule, m, None)
                strategy = self.runs(strategy_suite, "strategy", model, schedule, m, None)
                pair = self.pair(hand, strategy)
                if pair:
                    cpu = self.pair(
                        self.runs(suite, "hand", model, schedule, m, None, field="cpu_ms"),
                        self.runs(strategy_suite, "strategy", model, schedule, m, None, field="cpu_ms"),
                    )
                    out[name].append({"schedule": schedule, "microbatches": m, **pair, "cpu": cpu})
        for name, kind in (("small_log", "strategy_log"), ("small_nosigterm", "strategy_nosigterm")):
            out[name] = self.pair(
                self.runs("small", "hand", small, "1F1B", 4, None),
                self.runs("small", kind, small, "1F1B", 4, None),
            )
            if out[name]:
                out[name]["cpu"] = self.pair(
                    self.runs("small", "hand", small, "1F1B", 4, None, field="cpu_ms"),
                    self.runs("small", kind, small, "1F1B", 4, None, field="cpu_ms"),
                )
        out["lightning_own"] = self.pair(
            self.runs("small", "single_hand", small, None, 1, None),
            self.runs("small", "single_lightning", small, None, 1, None),
        )
        out["one_process"] = self.pair(
            self.runs("small", "hand", small, "1F1B", 4, "one process", field="cpu_ms"),
            self.runs("small", "strategy", small, "1F1B", 4, "one process", field="cpu_ms"),
        )
        one_f_one_b = [r for r in out["small"] if r["schedule"] == "1F1B"]
        worst = max(out["compute"], key=lambda r: r["ratio"]["median"], default=None)
        cpu = one_f_one_b[0]["cpu"] if one_f_one_b else None
        out["targets"] = {
            "small_overhead_ms": one_f_one_b[0]["diff"]["median"] if one_f_one_b else None,
            "small_overhead_ci": one_f_one_b[0]["diff_ci"] if one_f_one_b else None,
            "compute_ratio_schedule": worst["schedule"] if worst else None,
            "compute_ratio_ci": worst["ratio_ci"] if worst else None,
            # The same fixed cost in CPU time (both processes): what other jobs on a shared machine disturb least.
            "small_overhead_cpu_ms": cpu["diff"]["median"] if cpu else None,
            "small_overhead_target_ms": FIXED_COST_TARGET_MS,
            "compute_ratio": worst["ratio"]["median"] if worst else None,
            "compute_ratio_target": RATIO_TARGET,
        }
        return out

    def speedup(self) -> list[dict[str, Any]]:
        big = "tiny" if "tiny" in self.models else "compute"
        rows = []
        for schedule, v in STAGES_PER_RANK.items():
            for m in (2, 4, 8, 16):
                single = self.runs("speedup", "single_hand", big, None, m, None)
                pipe = self.runs("speedup", "strategy", big, schedule, m, None)
                pair = self.pair(pipe, single)  # ratio = single / pipeline = speedup
                if pair:
                    rows.append(
                        {
                            "schedule": schedule,
                            "microbatches": m,
                            "single_ms": pair["b"],
                            "pipeline_ms": pair["a"],
                            "speedup": pair["ratio"],
                            "ideal": ideal_speedup(K, m, v),
                        }
                    )
        return rows

    def ddp(self) -> dict[str, Any]:
        big = "tiny" if "tiny" in self.models else "compute"
        single = self.runs("ddp", "single_lightning", big, None, 1, None)
        rows = {
            "one process, Lightning": single,
            "one process, hand loop": self.runs("ddp", "single_hand", big, None, 1, None),
            "ddp, 2 processes": self.runs("ddp", "ddp", big, None, None, None),
        }
        for schedule in STAGES_PER_RANK:
            rows[f"pipeline {schedule}, M=8"] = self.runs("speedup", "strategy", big, schedule, 8, None)
        out = {}
        for name, runs in rows.items():
            pair = self.pair(runs, single)
            if pair:
                out[name] = {"ms": pair["a"], "speedup": pair["ratio"]}
        return out

    def evaluation(self) -> dict[str, Any]:
        big = "tiny" if "tiny" in self.models else "compute"
        single = self.runs("eval", "eval_single", big, None, None, None)
        out = {}
        for m in (2, 8):
            pair = self.pair(single, self.runs("eval", "eval_strategy", big, "1F1B", m, None))
            if pair:
                out[f"eval_microbatches={m}"] = pair
        return out

    def timeline(self) -> dict[str, Any]:
        bubbles, charts = [], []
        for key, runs in self.by_key.items():
            if key[0] != "timeline":
                continue
            for record in runs.values():
                values = list(record.get("bubbles", {}).values())
                if values:
                    schedule, m = key[3], key[4]
                    bubbles.append(
                        {
                            "schedule": schedule,
                            "microbatches": m,
                            "measured": spread(values),
                            "theory": theoretical_bubble(K, m, STAGES_PER_RANK[schedule]),
                        }
                    )
                charts += [f for f in record.get("files", []) if f.endswith(".png")]
        small = "tiny" if "tiny" in self.models else "small"
        cost = self.pair(
            self.runs("timeline_cost", "strategy", small, "1F1B", 4, None),
            self.runs("timeline_cost", "timeline", small, "1F1B", 4, None),
        )
        return {"bubbles": bubbles, "charts": charts, "cost": cost}


# ---------------------------------------------------------------------------------------------------- output
def _ms(s: dict[str, Any] | None, digits: int = 1) -> str:
    if not s:
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def _x(s: dict[str, Any] | None) -> str:
    if not s:
        return "-"
    return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


#: where the targets are settled: a handful of runs of each loop apart rarely has an interval narrow enough
_SETTLED_BY_PAIRS = (
    "A few runs of each case vary by more than the targets' margins: `benchmarks/phases.py --alternate` pairs the two"
    ' loops step by step in one training and measures both targets to a few hundredths ("Reading these figures").'
)


def _met(value: float | None, target: float, ci: dict[str, float] | None, digits: int, unit: str = "") -> str:
    """What the runs say of ``target``: read from the interval of their mean where there is one (a median of a few
    runs on one side of the target says little when their interval spans it), else from ``value`` alone."""
    if value is None:
        return "not measured"
    if not ci or ci["n"] < 2:
        return ("met" if value <= target else "**not met**") + " (one run, no interval)"
    said = verdict(ci, target, unit).rstrip(".")
    return f"mean over the runs {ci['mean']:.{digits}f}{unit}; by its 95% confidence interval, {said}"


def markdown(results: dict[str, Any], images: list[Path], docs: Path) -> str:
    m = results["machine"]
    o, t = results["overhead"], results["overhead"]["targets"]
    rel = {p.name: _relative(p, docs.parent) for p in images}
    lines = [
        BEGIN,
        "",
        "## Strategy, hand-written loop, one process, DDP: side by side",
        "",
        f"`python benchmarks/run.py`{' --quick' if results['quick'] else ''}, {results['date']}, "
        f"{results['elapsed_s'] // 60} min {results['elapsed_s'] % 60} s. Machine: {m.get('cpu')}, "
        f"{m.get('cpu_cores')} cores{', GPUs: ' + ', '.join(m['gpus']) if m.get('gpus') else ', no GPU'}; "
        f"torch {m.get('torch')}, Lightning {m.get('lightning')}, Python {m.get('python')}; "
        f"{m.get('torch_threads')} thread per process (`OMP_NUM_THREADS={m.get('OMP_NUM_THREADS')}`); "
        f"load average when the run started: {', '.join(f'{x:.1f}' for x in m.get('load_average') or [])}.",
        "",
        *(
            [
                "**`--quick`: a smoke run (the tiny network stands in for every model, one step per run); its figures"
                " mean nothing.**",
                "",
            ]
            if results["quick"]
            else []
        ),
        f"Every figure: the median over {results['runs']} runs of each run's median step time (wall clock, rank 0, "
        "from the start of one batch to the start of the next, warm-up steps excluded), with the lowest and highest "
        "run in parentheses. A ratio or difference is taken run by run between cases that ran next to each other "
        "(each strategy case next to its hand-loop case, in the order reversed every other run); where a mean with "
        "its 95% confidence interval is given, it is over those per-run values (Student's t).",
        "",
        "### Overhead over the hand-written loop",
        "",
        "The hand-written loop is the tutorial's (`benchmarks/hand.py`): `PipelineStage` + the torch schedule + "
        "`schedule.step` on the same DataLoader; the strategy runs an ordinary LightningModule "
        "(`benchmarks/lit.py`) with `Trainer(strategy=PipelineParallelStrategy(schedule=..., microbatches=...))`.",
        "",
        f"Targets: fixed cost per step on the small network (1F1B) at most {t['small_overhead_target_ms']} ms: "
        f"**{_num(t['small_overhead_ms'], 2)} ms** wall clock ({_num(t.get('small_overhead_cpu_ms'), 2)} ms of CPU "
        f"time, both processes); "
        f"{_met(t['small_overhead_ms'], t['small_overhead_target_ms'], t.get('small_overhead_ci'), 2, ' ms')}. "
        f"Ratio on the compute-bound network at most {t['compute_ratio_target']}: worst schedule"
        f"{' (' + t['compute_ratio_schedule'] + ')' if t.get('compute_ratio_schedule') else ''} "
        f"**{_num(t['compute_ratio'], 3)}**; "
        f"{_met(t['compute_ratio'], t['compute_ratio_target'], t.get('compute_ratio_ci'), 3)}. "
        f"{_SETTLED_BY_PAIRS if t.get('small_overhead_ci') or t.get('compute_ratio_ci') else ''}",
        "",
        "Small network (4 x Linear(256) + ReLU, batch 64, 4 microbatches), ms per step:",
        "",
        "| schedule | hand-written loop | strategy | strategy - hand | ratio | strategy - hand, CPU time |",
        "|---|---|---|---|---|---|",
    ]
    for row in o["small"]:
        cpu = row.get("cpu")
        lines.append(
            f"| {row['schedule']} | {_ms(row['a'], 2)} | {_ms(row['b'], 2)} | {_ms(row['diff'], 2)} | "
            f"{_x(row['ratio'])} | {_ms(cpu['diff'], 2) if cpu else '-'} |"
        )
    if o.get("small_log"):
        s = o["small_log"]
        lines.append(
            f"| 1F1B, with `self.log` | {_ms(s['a'], 2)} | {_ms(s['b'], 2)} | {_ms(s['diff'], 2)} | "
            f"{_x(s['ratio'])} | {_ms(s['cpu']['diff'], 2) if s.get('cpu') else ''} |"
        )
    if o.get("small_nosigterm"):
        s = o["small_nosigterm"]
        lines.append(
            f"| 1F1B, without Lightning's per-step SIGTERM broadcast (benchmark-only patch) | {_ms(s['a'], 2)} | "
            f"{_ms(s['b'], 2)} | {_ms(s['diff'], 2)} | {_x(s['ratio'])} |"
            f" {_ms(s['cpu']['diff'], 2) if s.get('cpu') else ''} |"
        )
    lines += [
        "",
        "CPU time: user + system time of both processes per step (all their threads); waiting for the other process"
        " costs none, so it counts the work a step adds, not when it happens.",
        "",
        "Lightning's training loop broadcasts a tensor from rank 0 at the start of every step of any multi-process run"
        " (`DDPStrategy` included), to agree on whether a SIGTERM arrived: one collective per step that the"
        " hand-written loop does not make, part of Lightning's own cost. The last row shows the strategy without it.",
    ]
    lines += ["", "Compute-bound network (8 x Linear(1024) + ReLU, batch 512, 8 microbatches), ms per step:", ""]
    lines += [
        "| schedule | hand-written loop | strategy | ratio | ratio: mean [95% CI] | ratio, CPU time |",
        "|---|---|---|---|---|---|",
    ]
    for row in o["compute"]:
        cpu = row.get("cpu")
        lines.append(
            f"| {row['schedule']} | {_ms(row['a'])} | {_ms(row['b'])} | {_x(row['ratio'])} |"
            f" {ci(row.get('ratio_ci'), 3, alone=False)} | {_x(cpu['ratio']) if cpu else '-'} |"
        )
    if "overhead.png" in rel:
        lines += ["", f"![strategy against the hand-written loop]({rel['overhead.png']})"]
    lines += ["", "For reference, on one process (small network):", ""]
    lines += ["| what | baseline | with | difference |", "|---|---|---|---|"]
    if o.get("lightning_own"):
        s = o["lightning_own"]
        lines.append(
            f"| Lightning's own loop (one device) against a hand loop, no microbatches, ms/step (wall) | "
            f"{_ms(s['a'], 2)} | {_ms(s['b'], 2)} | {_ms(s['diff'], 2)} |"
        )
    if o.get("one_process"):
        s = o["one_process"]
        lines.append(
            "| the strategy on a one-stage pipeline against the hand loop on one stage (1F1B, 4 microbatches): no "
            f"communication, the Python cost alone, CPU ms/step | {_ms(s['a'], 2)} | {_ms(s['b'], 2)} | "
            f"{_ms(s['diff'], 2)} |"
        )
    lines += _speedup_md(results, rel) + _ddp_md(results) + _eval_md(results) + _timeline_md(results, rel)
    lines += ["", END]
    return "\n".join(lines)


def _speedup_md(results: dict[str, Any], rel: dict[str, str]) -> list[str]:
    rows = results["speedup"]
    if not rows:
        return []
    lines = [
        "",
        "### Pipeline against one process",
        "",
        "The compute-bound network, 2 processes, against one process holding the whole network and running the same "
        "microbatches with gradient accumulation (`benchmarks/hand.py: single_loop`). Ideal: `K*M / (M + (K-1)/v)` "
        "with `K = 2` processes and `v` stages per process (2 for Interleaved1F1B and ZBVZeroBubble): no "
        "communication, equal stages.",
        "",
        "| schedule | M | one process, ms | pipeline, ms | speedup | ideal | efficiency |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['microbatches']} | {_ms(r['single_ms'], 0)} | {_ms(r['pipeline_ms'], 0)} | "
            f"{_x(r['speedup'])} | {r['ideal']:.3f} | {r['speedup']['median'] / r['ideal']:.2f} |"
        )
    if "speedup.png" in rel:
        lines += ["", f"![measured speedup against the ideal per schedule]({rel['speedup.png']})"]
    return lines


def _ddp_md(results: dict[str, Any]) -> list[str]:
    rows = results["ddp"]
    if not rows:
        return []
    lines = [
        "",
        '### What a user would pick instead: `strategy="ddp"`',
        "",
        'The compute-bound network fits on one process, so data parallelism is the alternative: `strategy="ddp"` on '
        "the same 2 processes (256 samples each, the same 512 per step). Speedup against Lightning on one process.",
        "",
        "| run | ms per step | speedup |",
        "|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | {_ms(r['ms'], 0)} | {_x(r['speedup'])} |")
    return lines


def _eval_md(results: dict[str, Any]) -> list[str]:
    rows = results["eval"]
    if not rows:
        return []
    lines = [
        "",
        "### Evaluation",
        "",
        "`trainer.validate` on the compute-bound network (batches of 512): the forward-only executor of 2 stages "
        "(1F1B placement) against one process's validation loop, ms per batch.",
        "",
        "| eval_microbatches | one process | pipeline | ratio |",
        "|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(f"| {name.split('=')[1]} | {_ms(r['a'])} | {_ms(r['b'])} | {_x(r['ratio'])} |")
    return lines


def _timeline_md(results: dict[str, Any], rel: dict[str, str]) -> list[str]:
    tl = results["timeline"]
    if not tl["bubbles"] and not tl["cost"]:
        return []
    lines = [
        "",
        "### Where the time goes: the timeline",
        "",
        "`PipelineTimeline` (see [Timeline](timeline.md)) on the compute-bound network: the measured bubble (idle "
        "fraction of each step's span, averaged over ranks; median and range of the recorded steps) against "
        "`(K-1) / (v*M + K-1)`.",
        "",
        "| schedule | M | measured bubble | theory |",
        "|---|---|---|---|",
    ]
    for b in tl["bubbles"]:
        s = b["measured"]
        lines.append(
            f"| {b['schedule']} | {b['microbatches']} | {s['median']:.1%} ({s['min']:.1%}-{s['max']:.1%}) | "
            f"{b['theory']:.1%} |"
        )
    for name, path in rel.items():
        if name.startswith("timeline-"):
            lines += ["", f"![{name[9:-4]}]({path})"]
    if tl["cost"]:
        c = tl["cost"]
        lines += [
            "",
            f"Recording cost on the small network (1F1B, 4 microbatches), timeline on against off: ratio "
            f"{_x(c['ratio'])}, {_ms(c['diff'], 2)} ms per step.",
        ]
    return lines


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path.resolve())


def write_docs(results: dict[str, Any], docs: Path, images: list[Path]) -> None:
    """Replace the generated section of ``docs`` (or append one)."""
    write_section(docs, markdown(results, images, docs), BEGIN, END)


def write_section(docs: Path, block: str, begin: str, end: str) -> None:
    """Put ``block`` (which starts with ``begin`` and ends with ``end``) in place of ``docs``' section between those
    markers, or append it."""
    text = docs.read_text() if docs.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    docs.write_text(text)


def summary(results: dict[str, Any]) -> str:
    t = results["overhead"]["targets"]
    return (
        f"small-network overhead (1F1B): {_num(t['small_overhead_ms'], 2)} ms/step (target <= 1.5); "
        f"compute-bound ratio (worst schedule): {_num(t['compute_ratio'], 3)} (target <= 1.02)"
    )


def plots(results: dict[str, Any], img: Path) -> list[Path]:
    """overhead.png and speedup.png (needs matplotlib, the ``plots`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    o = results["overhead"]
    if o["small"] or o["compute"]:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
        for ax, name, title in ((axes[0], "small", "small network"), (axes[1], "compute", "compute-bound network")):
            rows = o[name]
            xs = range(len(rows))
            for offset, side, label in ((-0.2, "a", "hand-written loop"), (0.2, "b", "strategy")):
                med = [r[side]["median"] for r in rows]
                err = [
                    [r[side]["median"] - r[side]["min"] for r in rows],
                    [r[side]["max"] - r[side]["median"] for r in rows],
                ]
                ax.bar([x + offset for x in xs], med, width=0.4, yerr=err, capsize=3, label=label)
            ax.set_xticks(list(xs), [r["schedule"] for r in rows], fontsize=8)
            ax.set_ylabel("ms per step")
            ax.set_title(title, fontsize=10)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        written.append(img / "overhead.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    rows = results["speedup"]
    if rows:
        schedules = list(dict.fromkeys(r["schedule"] for r in rows))
        fig, axes = plt.subplots(1, len(schedules), figsize=(3.2 * len(schedules), 3.2), sharey=True, squeeze=False)
        for ax, schedule in zip(axes[0], schedules):
            mine = [r for r in rows if r["schedule"] == schedule]
            ms = [r["microbatches"] for r in mine]
            med = [r["speedup"]["median"] for r in mine]
            err = [
                [r["speedup"]["median"] - r["speedup"]["min"] for r in mine],
                [r["speedup"]["max"] - r["speedup"]["median"] for r in mine],
            ]
            ax.errorbar(ms, med, yerr=err, marker="o", capsize=3, label="measured")
            ax.plot(ms, [r["ideal"] for r in mine], "k--", label="ideal")
            ax.axhline(1.0, color="grey", lw=0.5)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ms, [str(m) for m in ms])
            ax.set_xlabel("microbatches M")
            ax.set_title(schedule, fontsize=10)
        axes[0][0].set_ylabel("speedup over one process")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        written.append(img / "speedup.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
