"""Data parallel x pipeline against plain DDP, on 4 processes: step time and what each rank holds.

Runs a GPT-2-style model that fits on one process, three ways, each as its own 4-process launch (Lightning's
launcher re-runs this script for ranks 1-3):

- ``ddp``: Lightning's ``DDPStrategy`` (4 replicas of the whole model);
- ``pipeline-ddp``: ``PipelineParallelStrategy(pipeline_size=2, data_parallel="ddp")`` (2 replicas of 2 stages);
- ``pipeline-fsdp``: the same with ``data_parallel="fsdp"`` (each stage sharded over its 2 replicas).

Every run trains on the same global batch per optimizer step (``--global-batch`` samples: split over 4 replicas
under DDP, over 2 under the pipelines, whose replicas run it as 4 microbatches). Per run: the median wall-clock
step time of rank 0 after ``--warmup`` steps, the largest per-rank parameter, gradient and optimizer-state bytes
(:func:`lightning_pipe.measure.memory.state_bytes`, local shards for FSDP) and the largest per-rank peak resident set.
Each configuration runs ``--runs`` times; the table reports medians over runs.

Run from the repository root::

    python benchmarks/data_parallel.py      # --layers 8 --width 128 --seq 64 --global-batch 16 --steps 12 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_pipe  # noqa: E402
from lightning_pipe.measure.memory import format_bytes, state_bytes  # noqa: E402
from tests.gpt2 import GPT2  # noqa: E402

VOCAB = 256
CONFIGS = ("ddp", "pipeline-ddp", "pipeline-fsdp")
PROCESSES = 4


class LitGPT(L.LightningModule):
    def __init__(self, layers: int, width: int, seq: int, batch: int, samples: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT2(vocab=VOCAB, block_size=seq, n_layer=layers, n_head=4, n_embd=width)

    def forward(self, idx):
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (self.hparams.samples, self.hparams.seq + 1), generator=g)
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=self.hparams.batch)


class Measure(L.Callback):
    """Wall-clock time of each optimizer step, and this rank's state bytes after training."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.start = 0.0
        self.state: dict[str, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.start:
            self.start = time.perf_counter()

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        now = time.perf_counter()
        self.steps.append(now - self.start)
        self.start = now

    def on_train_end(self, trainer, pl_module):
        b = state_bytes(pl_module, trainer.optimizers)
        self.state = {"parameters": b.parameters, "gradients": b.gradients, "optimizer_state": b.optimizer_state}


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0)
    replicas = PROCESSES if args.config == "ddp" else PROCESSES // 2
    batch = args.global_batch // replicas
    model = LitGPT(args.layers, args.width, args.seq, batch, samples=args.global_batch * (args.steps + 1))
    if args.config == "ddp":
        strategy: object = "ddp"
    else:
        strategy = lightning_pipe.PipelineParallelStrategy(
            pipeline_size=2, schedule="1F1B", microbatches=4, data_parallel=args.config.removeprefix("pipeline-")
        )
    measure = Measure()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=PROCESSES,
        max_steps=args.steps,
        callbacks=[measure],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    result = {
        "steps": measure.steps,
        "state": measure.state,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    Path(args.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def launch(args: argparse.Namespace, config: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, "--worker", "--config", config, "--out", out]
        sizes = ("layers", "width", "seq", "global_batch", "steps")
        cmd += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in sizes]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    steps = ranks[0]["steps"][args.warmup :]
    return {
        "step": statistics.median(steps),
        "state": max(sum(r["state"].values()) for r in ranks),
        "parameters": max(r["state"]["parameters"] for r in ranks),
        "gradients": max(r["state"]["gradients"] for r in ranks),
        "optimizer": max(r["state"]["optimizer_state"] for r in ranks),
        "rss": max(r["peak_rss"] for r in ranks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=16, help="samples per optimizer step, all replicas")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for config in args.configs.split(","):
        runs = [launch(args, config) for _ in range(args.runs)]
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        steps = sorted(r["step"] for r in runs)
        rows.append((config, median, steps))
        print(f"{config}: {json.dumps(median)}", file=sys.stderr)
    print(
        "| run | step time, s (median of runs; min-max) | parameters | gradients | optimizer state | "
        "state, largest rank | peak RSS, largest rank |"
    )
    print("|---|---|---|---|---|---|---|")
    for config, m, steps in rows:
        print(
            f"| {config} | {m['step']:.3f} ({steps[0]:.3f}-{steps[-1]:.3f}) | {format_bytes(m['parameters'])} |"
            f" {format_bytes(m['gradients'])} | {format_bytes(m['optimizer'])} | {format_bytes(m['state'])} |"
            f" {format_bytes(m['rss'])} |"
        )


if __name__ == "__main__":
    main()
