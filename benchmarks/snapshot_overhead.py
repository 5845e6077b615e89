"""What the in-memory snapshots of recovery in place (``snapshot_every``) cost a training step, and their host memory.

Two models, each on 2 pipeline stages (gloo, CPU) under Lightning's launcher with ``max_restarts=1`` (which recovery in
place needs; nothing fails here):

- ``gpt``: the GPT example (examples/gpt/train.py, its config: 4 blocks of width 128, batch 16 of 128 bytes,
  1F1B over 4 microbatches, AdamW, clipping), validation off;
- ``tiny``: the test model (tests/models.py ``LitLM``: 8 blocks of width 16, Adam), the one benchmarks/recovery.py
  kills.

Each interval in ``--every`` runs ``--steps`` steps, ``--repeats`` times, interleaved with runs without snapshots
(``snapshot_every=0``, supervised as well). Per run and rank: every step's time (from one batch start to the next:
what the training loop waited for, the snapshot's copy to host memory and the thread's start included), the seconds
each snapshot blocked its step (the copy), the seconds its thread took (serialising, the exchange with the buddy,
the barrier), and the host memory the snapshots take. The overhead at an interval is the mean step time with
snapshots against the mean without (the thread competes with the step for the cores); the blocking cost per
snapshot, amortised over the interval, is printed beside it.

    flock /tmp/bench.lock nice python benchmarks/snapshot_overhead.py --model gpt --every 1 10 --out /tmp/snap

Results: docs/benchmarks.md (Recovery in place) and the default of ``snapshot_every`` (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WARMUP = 5  # steps left out of the means (the first steps build and warm up)


def _gpt() -> tuple:
    spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples" / "gpt" / "train.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.GPTLightning(block_size=128, n_layer=4, n_head=4, n_embd=128, lr=3e-3, warmup_steps=50)
    return model, example.StdlibBytes(block_size=128, batch_size=16), {"schedule": "1F1B", "microbatches": 4}


def _tiny() -> tuple:
    from tests.models import LitLM

    return LitLM(optimizer="adam", samples=4096), None, {}


def _in_the_step() -> None:
    """``--synchronous``: the snapshot's thread runs where it would start (at the next batch request), so the step
    waits for the serialising and the exchange too: the comparison with the snapshots before they had a thread."""
    from lightning_pipe.checkpoint import snapshot

    class InTheStep:
        def __init__(self, target, name: str = "", daemon: bool = True) -> None:
            self.target = target

        def start(self) -> None:
            self.target()

        def join(self) -> None:
            pass

    snapshot.threading = type("threading", (), {"Thread": InTheStep, "Lock": snapshot.threading.Lock})  # type: ignore


def child(args: argparse.Namespace) -> None:
    """One run, as every rank runs it (Lightning's launcher starts the ranks again with this command line)."""
    import lightning.pytorch as L

    from lightning_pipe import PipelineParallelStrategy

    if args.synchronous:
        _in_the_step()
    L.seed_everything(0)
    model, data, options = _gpt() if args.model == "gpt" else _tiny()
    starts: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            starts.append(time.perf_counter())

    # Runs without snapshots are supervised too (`max_restarts=1`): the same launch, the same watching processes.
    strategy = PipelineParallelStrategy(pipeline_size=2, max_restarts=1, snapshot_every=args.every, **options)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0 if args.model == "gpt" else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock()],
    )
    trainer.fit(model, datamodule=data) if data is not None else trainer.fit(model)
    snapshots = strategy._snapshots
    record = {
        "steps": [b - a for a, b in zip(starts, starts[1:])],  # step i+1's time: from its batch start to the next
        "bytes": snapshots.nbytes() if snapshots else 0,
        "snapshot_bytes": snapshots.last_bytes if snapshots else 0,
        "timings": list(snapshots.timings) if snapshots else [],
    }
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def run(out: Path, model: str, every: int, steps: int, synchronous: bool = False) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--child", "--model", model, "--every", str(every), "--steps", str(steps)]
    command += ["--synchronous"] if synchronous else []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([*command, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{model} every={every} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    # Both ranks run the same steps; the step time is the slower rank's (the pipeline waits for it).
    times = [max(pair) for pair in zip(*(r["steps"] for r in ranks))][WARMUP:]
    first = WARMUP + 1  # times[i] is the step after which the global step is first + i
    taken = [i for i in range(len(times)) if every and (first + i) % every == 0]  # the copy at its end
    after = [i for i in range(len(times)) if every and (first + i - 1) % every == 0]  # the thread beside it
    others = [t for i, t in enumerate(times) if i not in taken and i not in after]
    return {
        "model": model,
        "every": every,
        "synchronous": synchronous,
        "mean_step_s": statistics.fmean(times),
        "median_step_s": statistics.median(times),
        "median_step_with_snapshot_s": statistics.median([times[i] for i in taken]) if taken else None,
        "median_step_after_snapshot_s": statistics.median([times[i] for i in after]) if after else None,
        "median_step_other_s": statistics.median(others) if taken and others else None,
        "blocking_s": [statistics.median([t[1] for t in r["timings"]]) if r["timings"] else None for r in ranks],
        "background_s": [statistics.median([t[2] for t in r["timings"]]) if r["timings"] else None for r in ranks],
        "host_bytes": [r["bytes"] for r in ranks],
        "snapshot_bytes": [r["snapshot_bytes"] for r in ranks],
        "load": Path("/proc/loadavg").read_text().split()[:3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt", "tiny"], default="gpt")
    parser.add_argument("--every", type=int, nargs="+", default=[1, 10], help="snapshot intervals to measure")
    parser.add_argument("--steps", type=int, default=45)
    parser.add_argument("--repeats", type=int, default=2, help="runs per interval (each beside one without)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--synchronous", action="store_true", help="serialise and exchange in the step (no thread)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.every = args.every[0]
        child(args)
        return
    rows = []
    for repeat in range(args.repeats):
        for every in args.every:
            for interval in (0, every):
                out = args.out / f"{args.model}-{interval}-{every}-{repeat}"
                row = run(out, args.model, interval, args.steps, args.synchronous and interval > 0)
                print(json.dumps(row), flush=True)
                rows.append(row)
    for every in args.every:
        on = [r["mean_step_s"] for r in rows if r["every"] == every]
        off = [r["mean_step_s"] for r in rows if r["every"] == 0]
        blocking = statistics.median(b for r in rows if r["every"] == every for b in r["blocking_s"] if b is not None)
        base = statistics.fmean(off)
        print(
            f"{args.model} every={every}: mean step {statistics.fmean(on):.4f} s against {base:.4f} s without"
            f" ({100 * (statistics.fmean(on) / base - 1):+.1f}%); the copy blocks {blocking * 1e3:.1f} ms a snapshot"
            f" ({100 * blocking / every / base:.2f}% of a step amortised)"
        )
    (args.out / f"{args.model}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
