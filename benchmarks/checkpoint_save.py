"""How long a checkpoint save blocks training, synchronous against asynchronous (``async_checkpoint=True``).

A 2-process pipeline (Lightning's launcher, gloo, CPU) of an MLP whose parameters and Adam state hold 201 MB (100 MB
per rank), a ``ModelCheckpoint`` every 10 steps. Per save, on each rank: how long ``save_checkpoint`` blocked the
step (the whole write when synchronous; the copy to host memory when asynchronous), and for asynchronous saves how
long the write itself took in its thread; the median step time without a save, and of the step after one.

    nice python benchmarks/checkpoint_save.py --out /tmp/ckpt-bench      # both modes, one after the other
    python benchmarks/checkpoint_save.py --mode async --out DIR            # one mode (what the above runs)

Results: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WIDTH = 1024
BLOCKS = 4
STEPS = 40
EVERY = 10


def module() -> Any:
    """The LightningModule: an MLP of residual blocks, Adam."""
    import lightning.pytorch as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
                for _ in range(BLOCKS)
            )

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x) if block is not None else x
            return x

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.net(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(8 * STEPS, WIDTH)), batch_size=8)

    return Module()


def child(mode: str, out: Path) -> None:
    import lightning.pytorch as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_pipe

    torch.set_num_threads(1)

    class Timed(lightning_pipe.PipelineParallelStrategy):
        records: list = []

        def save_checkpoint(self, checkpoint, filepath, storage_options=None):
            start = time.perf_counter()
            super().save_checkpoint(checkpoint, filepath, storage_options)
            record = {"blocked": time.perf_counter() - start, "written": None}
            writes = [p.write for p in self._checkpoints.writer.pending if p.write is not None]
            if writes:
                writes[-1].add_done_callback(lambda _: record.update(written=time.perf_counter() - start))
            self.records.append(record)

    class Steps(L.Callback):
        def __init__(self) -> None:
            self.times: list = []

        def on_train_batch_start(self, *args):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, *args):
            self.times.append((trainer.global_step, time.perf_counter() - self.start))

    L.seed_everything(0)
    strategy = Timed(async_checkpoint=mode == "async")
    steps = Steps()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=out / mode, every_n_train_steps=EVERY, save_top_k=-1), steps],
    )
    model = module()
    trainer.fit(model)
    state = sum(p.numel() * 4 * 3 for p in model.parameters())  # parameters and Adam's two moments
    result = {"rank": trainer.global_rank, "state_bytes": state, "saves": strategy.records, "steps": steps.times}
    (out / f"{mode}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


def report(out: Path) -> None:
    total = sum(json.loads((out / f"sync.rank{r}.json").read_text())["state_bytes"] for r in range(2))
    print(f"state saved per checkpoint: {total / 1e6:.0f} MB (2 ranks)")
    columns = ["mode", "rank", "blocked per save (median, max)", "write in its thread (median)", "step (median)"]
    print("| " + " | ".join([*columns, "step after a save (median)"]) + " |")
    print("|---|---|---|---|---|---|")
    for mode in ("sync", "async"):
        for rank in range(2):
            data = json.loads((out / f"{mode}.rank{rank}.json").read_text())
            blocked = [s["blocked"] for s in data["saves"]]
            written = [s["written"] for s in data["saves"] if s["written"] is not None]
            saved_at = {EVERY * (i + 1) for i in range(len(blocked))}
            plain = [t for step, t in data["steps"] if step > 2 and step not in saved_at and step - 1 not in saved_at]
            after = [t for step, t in data["steps"] if step - 1 in saved_at]
            row = [
                mode,
                str(rank),
                f"{statistics.median(blocked) * 1e3:.0f} ms, {max(blocked) * 1e3:.0f} ms",
                f"{statistics.median(written) * 1e3:.0f} ms" if written else "-",
                f"{statistics.median(plain) * 1e3:.0f} ms",
                f"{statistics.median(after) * 1e3:.0f} ms" if after else "-",
            ]
            print("| " + " | ".join(row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("sync", "async"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/ckpt-bench"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode:
        child(args.mode, args.out)
        return
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    for mode in ("sync", "async"):
        subprocess.run([sys.executable, __file__, "--mode", mode, "--out", str(args.out)], env=env, check=True)
    report(args.out)


if __name__ == "__main__":
    main()
