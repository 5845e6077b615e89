"""Soak run: many small pipeline steps with validation and checkpoints, watching each rank's memory, file descriptors
and threads for growth.

    nice python benchmarks/soak.py --steps 3000 --every 200 --out soak-out

2 processes (Lightning's launcher), a small LM (tests/models.py) on 1F1B, SGD; validation and ``last.ckpt`` every
``--every`` steps (the checkpoint is replaced each time: save, then rotation of the previous directory). Every rank
samples its resident set size, open file descriptors and threads every ``--sample`` steps (after the step, in
``on_train_batch_end``) into ``OUT/soak.rank<R>.jsonl``; rank 0 then prints a summary: figures at the first sample
after warm-up (the first validation and checkpoint) and at the end, and the least-squares RSS growth per step over the
samples after warm-up. The figures are in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as L
import psutil
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning_pipe  # noqa: E402
from tests.models import VOCAB, LitLM, token_dataset  # noqa: E402


class SoakLM(LitLM):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))
        self.log("val_loss", loss)
        return loss

    def val_dataloader(self):
        return DataLoader(token_dataset(32, seed=1), batch_size=8)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        pass  # LitLM keeps every loss in a list: that would be growth of our own making


class Sampler(L.Callback):
    """Every ``every`` steps: this process's RSS, open fds, threads (OS and Python), appended to a JSON-lines file."""

    def __init__(self, path: Path, every: int) -> None:
        self.path, self.every = path, every
        self.process = psutil.Process()
        self.start = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step % self.every and step != 1:
            return
        sample = {
            "step": step,
            "seconds": round(time.monotonic() - self.start, 2),
            "rss": self.process.memory_info().rss,
            "fds": self.process.num_fds(),
            "threads": self.process.num_threads(),
            "python_threads": threading.active_count(),
        }
        with self.path.open("a") as f:
            f.write(json.dumps(sample) + "\n")


def summary(out: Path, ranks: int, warmup: int) -> dict:
    result = {}
    for rank in range(ranks):
        samples = [json.loads(line) for line in (out / f"soak.rank{rank}.jsonl").read_text().splitlines()]
        settled = [s for s in samples if s["step"] >= warmup]
        steps = torch.tensor([float(s["step"]) for s in settled])
        rss = torch.tensor([float(s["rss"]) for s in settled])
        slope = float(((steps - steps.mean()) * (rss - rss.mean())).sum() / ((steps - steps.mean()) ** 2).sum())
        first, last = settled[0], settled[-1]
        result[rank] = {
            "steps": last["step"],
            "seconds": last["seconds"],
            "rss_first_sample_mib": round(samples[0]["rss"] / 2**20, 1),
            "rss_after_warmup_mib": round(first["rss"] / 2**20, 1),
            "rss_end_mib": round(last["rss"] / 2**20, 1),
            "rss_max_after_warmup_mib": round(max(s["rss"] for s in settled) / 2**20, 1),
            "rss_growth_bytes_per_step": round(slope, 1),
            "fds": sorted({s["fds"] for s in settled}),
            "threads": sorted({s["threads"] for s in settled}),
            "python_threads": sorted({s["python_threads"] for s in settled}),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--every", type=int, default=200, help="validation and checkpoint interval (steps)")
    parser.add_argument("--sample", type=int, default=50, help="sampling interval (steps)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("soak-out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    (args.out / f"soak.rank{rank}.jsonl").unlink(missing_ok=True)
    torch.set_num_threads(1)
    L.seed_everything(0)
    # An epoch of 5 checkpoint intervals: epoch ends, validation, checkpoints and their rotation all recur.
    model = SoakLM(n_layers=4, samples=8 * 5 * args.every, lr=0.01)
    trainer = L.Trainer(
        strategy=lightning_pipe.PipelineParallelStrategy(timeout=timedelta(minutes=5)),
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.steps,
        val_check_interval=args.every,
        num_sanity_val_steps=0,
        logger=False,
        callbacks=[
            ModelCheckpoint(dirpath=args.out / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=args.every),
            Sampler(args.out / f"soak.rank{rank}.jsonl", args.sample),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.monotonic()
    trainer.fit(model)
    trainer.strategy.barrier()
    if trainer.global_rank == 0:
        ranks = summary(args.out, args.devices, warmup=2 * args.every)
        result = {"wall_seconds": round(time.monotonic() - start, 1), "ranks": ranks}
        (args.out / "summary.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
