"""Python calls per microbatch that the strategy makes beyond the hand-written loop, on each rank.

    python benchmarks/step_calls.py                      # this tree, ~1 minute; prints the table
    python benchmarks/step_calls.py --tree /path/to/old  # another checkout (e.g. `git archive REV | tar -x -C DIR`)
    python benchmarks/step_calls.py --docs docs/benchmarks.md  # also rewrites its section there

A count, not a time: the machine's load moves every timing of a step, but not how many Python functions (and
builtins) a step calls. The small network (4 x Linear(256) + ReLU, batch 64) under GPipe on 2 processes, the hand loop
(benchmarks/hand.py), Lightning's loop driving it (benchmarks/lit.py ``HandModule``, the floor of ``phases.py
--floor``) and the strategy (benchmarks/lit.py), each trained at 1 and at 16 microbatches; ``cProfile`` counts every
call on each rank's main thread over the steps after a warm-up. Per rank and loop, the calls of one more microbatch are
``(calls at 16 - calls at 1) / 15`` a step, and the first table gives the strategy's minus the hand loop's, with the
functions that make most of it. The second gives the calls of a whole step at 1 microbatch: the strategy's minus the
floor's is what the strategy itself adds to a step (its fixed cost, counted). What a microbatch costs in time is
benchmarks/microbatches.py's, a step's phases.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
BEGIN = "<!-- benchmarks/step_calls.py: begin (generated, do not edit by hand) -->"
END = "<!-- benchmarks/step_calls.py: end -->"
COUNTS = (1, 16)
STEPS, WARMUP = 60, 10
#: the loops counted: the hand loop, Lightning's loop driving it (the floor, at the lower count only) and the strategy
LOOPS = ("hand", "floor", "strategy")


def per_microbatch(calls: dict[tuple[str, int], dict[str, int]]) -> dict[str, dict[str, float]]:
    """``calls[(loop, microbatches)][function]`` (calls per step) to the calls of one more microbatch, per loop and
    function: the difference between the two counts over the microbatches between them."""
    (low, high), out = COUNTS, {}
    for loop in ("hand", "strategy"):
        a, b = calls[(loop, low)], calls[(loop, high)]
        out[loop] = {f: (b.get(f, 0) - a.get(f, 0)) / (high - low) for f in set(a) | set(b)}
    return out


def summarize(ranks: list[dict[str, Any]], top: int = 8) -> dict[str, Any]:
    """Per rank: the calls per microbatch of each loop, their difference and the functions that differ most."""
    out = []
    for rank, calls in enumerate(ranks):
        per = per_microbatch({(loop, int(m)): fns for loop, by_m in calls.items() for m, fns in by_m.items()})
        hand, strategy = per["hand"], per["strategy"]
        diff = {f: strategy.get(f, 0) - hand.get(f, 0) for f in set(hand) | set(strategy)}
        most = sorted((f for f in diff if abs(diff[f]) >= 0.5), key=lambda f: (-abs(diff[f]), f))[:top]
        step = {loop: sum(calls[loop][str(COUNTS[0])].values()) for loop in LOOPS if loop in calls}
        out.append(
            {
                "rank": rank,
                "hand": sum(hand.values()),
                "strategy": sum(strategy.values()),
                "diff": sum(diff.values()),
                "most": [(f, diff[f]) for f in most],
                # calls of a whole step at the lower count, per loop (the floor: Lightning's loop driving the hand loop)
                "step": step,
            }
        )
    return {"ranks": out}


def markdown(summary: dict[str, Any], tree: str) -> str:
    lines = [
        BEGIN,
        "",
        "### Results: Python calls per microbatch",
        "",
        f"`python benchmarks/step_calls.py` ({tree}): calls per extra microbatch on each rank's main thread, GPipe, 2"
        f" processes, {STEPS} steps after {WARMUP} at 1 and 16 microbatches (a count: the load does not move it).",
        "",
        "| rank | hand loop | strategy | strategy - hand | most of the difference |",
        "|---|---|---|---|---|",
    ]
    for r in summary["ranks"]:
        most = ", ".join(f"{_short(f)} {d:+.0f}" for f, d in r["most"])
        lines.append(f"| {r['rank']} | {r['hand']:.0f} | {r['strategy']:.0f} | {r['diff']:+.0f} | {most} |")
    if all("floor" in r["step"] for r in summary["ranks"]):
        lines += [
            "",
            f"Calls of a whole step at {COUNTS[0]} microbatch, the floor being Lightning's loop driving the hand loop"
            " (what the strategy adds to a step is its count minus the floor's):",
            "",
            "| rank | hand loop | Lightning + hand loop (floor) | strategy | strategy - floor |",
            "|---|---|---|---|---|",
        ]
        for r in summary["ranks"]:
            step = r["step"]
            lines.append(
                f"| {r['rank']} | {step['hand']:.0f} | {step['floor']:.0f} | {step['strategy']:.0f} |"
                f" {step['strategy'] - step['floor']:+.0f} |"
            )
    return "\n".join([*lines, "", END])


def _short(function: str) -> str:
    """A profiler key ``file:line(name)`` or ``~:0(<built-in ...>)`` as ``name`` with its module's file name."""
    where, _, name = function.partition("(")
    name = name.rstrip(")")
    if where.startswith("~"):
        return f"`{name.replace('<built-in method ', '').replace('<method ', '').rstrip('>')}`"
    file = Path(where.rsplit(":", 1)[0])
    return f"`{file.parent.name}/{file.name}:{name}`"


# ------------------------------------------------------------------------------------------------ the worker
def worker(out: Path) -> None:
    """One rank: both loops at both counts, every call counted; rank 0 gathers and writes ``out``."""
    import cProfile
    import pstats

    import lightning.pytorch as L
    import torch
    import torch.distributed as dist

    from benchmarks import hand, lit
    from benchmarks.common import MODELS, dataset, loader, pin_to_core
    from benchmarks.lit import pipeline_strategy

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    pin_to_core(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo")
    spec, device = MODELS["small"], torch.device("cpu")
    mine: dict[str, dict[str, dict[str, float]]] = {loop: {} for loop in LOOPS}
    for loop in LOOPS:
        for m in COUNTS[:1] if loop == "floor" else COUNTS:
            profile = cProfile.Profile()
            if loop == "hand":
                pipeline = hand.HandPipeline(spec, "GPipe", m, rank, world, device)
                batches = list(loader(dataset(spec, STEPS + WARMUP), spec.batch))
                for batch in batches[:WARMUP]:
                    pipeline.step(*batch)
                profile.enable()
                for batch in batches[WARMUP:]:
                    pipeline.step(*batch)
                profile.disable()
            elif loop == "floor":
                lit.fit_hand(spec, "GPipe", m, world, STEPS + WARMUP, extra=[_counting(L.Callback, profile)])
            else:
                strategy = pipeline_strategy({"schedule": "GPipe", "microbatches": m})
                lit.fit(spec, strategy, world, spec.batch, STEPS + WARMUP, extra=[_counting(L.Callback, profile)])
            stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
            mine[loop][str(m)] = {_key(k): v[1] / STEPS for k, v in stats.items()}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        out.write_text(json.dumps(every))
    dist.destroy_process_group()


def _counting(base: type, profile: Any) -> Any:
    """A Lightning callback (``base``: ``lightning.pytorch.Callback``) that runs ``profile`` over the steps after the
    warm-up."""

    class Counting(base):  # type: ignore[misc, valid-type]
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
            if index == WARMUP:
                profile.enable()

        def on_train_end(self, trainer: Any, module: Any) -> None:
            profile.disable()

    return Counting()


def _key(k: tuple[str, int, str]) -> str:
    """A profiler key as ``file:line(name)``, the file from its package (``torch/...``, ``lightning_pipe/...``)."""
    file, line, name = k
    for marker in ("site-packages/", "/lightning_pipe/", "/benchmarks/"):
        found = file.find(marker)
        if found >= 0:
            file = file[found + len(marker) :] if marker == "site-packages/" else file[found + 1 :]
            break
    return f"{file}:{line}({name})"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose lightning_pipe is counted")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "step_calls.json")
    parser.add_argument("--docs", type=Path, default=Path("-"), help="page to update ('-': none, the default)")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return {}
    from benchmarks import report
    from benchmarks.common import free_port

    tree = args.tree.resolve()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"]
    cmd += [str(Path(__file__).resolve()), "--worker", str(args.out.resolve())]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = summarize(json.loads(args.out.read_text()))
    label = "this tree" if tree == ROOT else str(tree)
    text = markdown(summary, label)
    if str(args.docs) != "-":
        report.write_section(args.docs, text, BEGIN, END)
    print(text)
    return summary


if __name__ == "__main__":
    main()
