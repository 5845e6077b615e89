"""What each frontend costs per step: the modules frontend against the dataflow frontend on the project's examples.

``frontend="auto"`` (the default) picks the dataflow frontend for a forward written for one device and the modules
frontend for a forward that skips the units other stages hold (:mod:`lightning_pipe.split.frontend`). This measures
what that choice costs, on the two examples whose forwards both frontends run:

- ``gpt``: the GPT example (``examples/gpt/train.py``: 4 blocks, width 128, 128 bytes, batch 16, AdamW, per-step
  LambdaLR, clipping; 1F1B, 4 microbatches), on the Python standard library's sources;
- ``cnn``: the CNN example (``examples/cnn/train.py``: a ResNet of width 16 on scikit-learn's 8x8 digits, batch 32,
  SGD; GPipe, 4 microbatches, split before ``layer3``). Needs scikit-learn (``pip install -e ".[examples]"``).

Each example runs as one launch of 2 processes (Lightning's launcher re-runs this script for rank 1), one thread
each, every process pinned to a core of its own. Within the launch, fresh Trainers alternate between the frontends
(modules, dataflow, modules, ...) ``--rounds`` times over, each from the same seed and weights, so a change in the
machine's load shows in both alike. Per Trainer: the median step (rank 0's wall clock, from one batch's start to the
next, after ``--warmup`` steps) and the median CPU time per step of both processes together (user + system, all
threads). The difference is taken round by round, between Trainers that ran next to each other. Results go to
``<out>/frontends.json`` and a markdown table to ``<out>/frontends.md``.

Run from the repository root, on a quiet machine::

    python benchmarks/frontends.py                       # both examples, 5 rounds of 30 steps
    python benchmarks/frontends.py --examples gpt --rounds 2 --steps 8 --warmup 2    # a smoke
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402

import lightning_pipe  # noqa: E402
from benchmarks.common import machine, pin_to_core  # noqa: E402

EXAMPLES = ("gpt", "cnn")
FRONTENDS = ("modules", "dataflow")


def _example(name: str):
    """The example's module, imported from its file (``examples/<name>/train.py``)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / name / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _setup(name: str, frontend: str) -> tuple[L.LightningModule, L.LightningDataModule, dict]:
    """The example's model, data and strategy arguments, as its config.yaml sets them."""
    example = _example(name)
    if name == "gpt":
        model = example.GPTLightning(block_size=128, n_layer=4, n_head=4, n_embd=128, lr=3e-3, warmup_steps=50)
        data = example.StdlibBytes(block_size=128, batch_size=16, val_every=20)
        settings = {"schedule": "1F1B", "microbatches": 4}
    else:
        model = example.DigitsClassifier(arch="resnet", width=16, lr=0.05)
        data = example.Digits(batch_size=32)
        settings = {"schedule": "GPipe", "microbatches": 4, "split_points": ["layer3"]}
    return model, data, {**settings, "frontend": frontend}


class Stamps(L.Callback):
    """Wall-clock and CPU time (this process, all threads) at the start of every training batch and at the end."""

    def __init__(self) -> None:
        self.wall: list[int] = []
        self.cpu: list[int] = []

    def _tick(self) -> None:
        self.wall.append(time.perf_counter_ns())
        self.cpu.append(time.process_time_ns())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._tick()

    def on_train_end(self, trainer, pl_module) -> None:
        self._tick()


def _periods(stamps: list[int], warmup: int) -> list[float]:
    return [(b - a) / 1e6 for a, b in zip(stamps, stamps[1:])][warmup:]


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    pin_to_core(rank)
    runs = []
    for round_ in range(args.rounds):
        for frontend in FRONTENDS:
            L.seed_everything(0, verbose=False)
            model, data, settings = _setup(args.example, frontend)
            stamps = Stamps()
            trainer = L.Trainer(
                accelerator="cpu",
                devices=2,
                strategy=lightning_pipe.PipelineParallelStrategy(**settings),
                max_steps=args.steps,
                limit_val_batches=0,
                num_sanity_val_steps=0,
                gradient_clip_val=1.0 if args.example == "gpt" else None,
                callbacks=[stamps],
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            trainer.fit(model, data)
            runs.append(
                {
                    "round": round_,
                    "frontend": frontend,
                    "wall": _periods(stamps.wall, args.warmup),
                    "cpu": _periods(stamps.cpu, args.warmup),
                }
            )
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(runs))


def launch(args: argparse.Namespace, example: str) -> list[dict]:
    """One launch of 2 processes for ``example``; per Trainer, rank 0's median wall step and the summed CPU step."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, "--worker", "--example", example, "--out", out]
        cmd += [f"--rounds={args.rounds}", f"--steps={args.steps}", f"--warmup={args.warmup}"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        done = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{example}: the launch failed:\n{done.stderr[-4000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    results = []
    for runs in zip(*ranks):
        cpu = [sum(steps) for steps in zip(*(r["cpu"] for r in runs))]
        results.append(
            {
                "round": runs[0]["round"],
                "frontend": runs[0]["frontend"],
                "wall_ms": statistics.median(runs[0]["wall"]),
                "cpu_ms": statistics.median(cpu),
            }
        )
    return results


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f} to {max(values):.2f})"


def _ratio_interval(ratios: list[float]) -> str:
    """The geometric mean of the round-by-round ratios and its 95% confidence interval (normal approximation on
    the logarithms: rounds are independent pairs of neighbouring Trainers)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    return f"{math.exp(mean):.3f} [{math.exp(mean - half):.3f}, {math.exp(mean + half):.3f}]"


def table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| example | modules, ms/step | dataflow, ms/step | dataflow / modules | dataflow / modules, geometric mean"
        " [95% CI] | dataflow - modules, CPU ms/step |",
        "|---|---|---|---|---|---|",
    ]
    for example, rows in results.items():
        by = {f: {r["round"]: r for r in rows if r["frontend"] == f} for f in FRONTENDS}
        rounds = sorted(set(by["modules"]) & set(by["dataflow"]))
        modules = [by["modules"][i]["wall_ms"] for i in rounds]
        dataflow = [by["dataflow"][i]["wall_ms"] for i in rounds]
        ratio = [d / m for m, d in zip(modules, dataflow)]
        cpu = [by["dataflow"][i]["cpu_ms"] - by["modules"][i]["cpu_ms"] for i in rounds]
        lines.append(
            f"| {example} | {_spread(modules)} | {_spread(dataflow)} | {_spread(ratio)} | {_ratio_interval(ratio)} |"
            f" {_spread(cpu)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", default=",".join(EXAMPLES))
    parser.add_argument("--rounds", type=int, default=5, help="Trainers per frontend, alternating")
    parser.add_argument("--steps", type=int, default=30, help="training steps per Trainer")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of each Trainer's median")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "frontends")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--example", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    start = time.time()
    info = machine()
    results = {example: launch(args, example) for example in args.examples.split(",")}
    text = (
        f"`python benchmarks/frontends.py --rounds {args.rounds} --steps {args.steps} --warmup {args.warmup}`,"
        f" {time.strftime('%Y-%m-%dT%H:%M:%S')}, {time.time() - start:.0f} s. {info['cpu']}, {info['cpu_cores']}"
        f" cores, torch {info['torch']}; 2 processes x 1 thread, each pinned to a core; load average at the start:"
        f" {', '.join(f'{x:.1f}' for x in info['load_average'] or ())}. Medians over rounds (lowest to highest).\n\n"
        + table(results)
        + "\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "frontends.json").write_text(
        json.dumps({"machine": info, "args": vars(args) | {"out": str(args.out)}, "results": results}, indent=1)
    )
    (args.out / "frontends.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
