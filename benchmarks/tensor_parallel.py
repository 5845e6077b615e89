"""Tensor parallelism inside pipeline stages: per-rank memory and step time at several (pp, tp) layouts.

The benchmark GPT, ready for tensor parallelism (GPT-2's blocks with separate q/k/v projections and the head count
taken from them), trained with AdamW on the same global batch per optimizer step in every layout:

- ``pp2-tp1``: ``pipeline_size=2`` on 2 processes (no tensor parallelism: the baseline);
- ``pp2-tp2``: ``pipeline_size=2, tensor_parallel=2`` on 4 processes;
- ``pp1-tp4``: ``pipeline_size=1, tensor_parallel=4`` on 4 processes (tensor parallelism alone);
- ``pp4-tp1``: ``pipeline_size=4`` on 4 processes (the same 4 processes as a pipeline only).

Each layout runs as its own launch (Lightning's launcher re-runs this script for the other ranks). Per run: the median
wall-clock step time of rank 0 after ``--warmup`` steps; per rank, the parameter, gradient and optimizer-state bytes
at the last optimizer step (:func:`lightning_pipe.measure.memory.state_bytes`: a DTensor counts its local part), the
bytes each stage saves for backward per microbatch (the strategy's memory report) and the peak resident set. The
table gives the largest rank of each. Each layout runs ``--runs`` times; medians over runs.

Run from the repository root::

    python benchmarks/tensor_parallel.py    # --layers 8 --width 256 --heads 8 --seq 64 --global-batch 8 --steps 10
"""

from __future__ import annotations

import argparse
import json
import math
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
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_pipe  # noqa: E402
from lightning_pipe.measure.memory import format_bytes, state_bytes  # noqa: E402

VOCAB = 1024
#: (name, pipeline_size, tensor_parallel, processes)
LAYOUTS = {
    "pp2-tp1": (2, 1, 2),
    "pp2-tp2": (2, 2, 4),
    "pp1-tp4": (1, 4, 4),
    "pp4-tp1": (4, 1, 4),
}


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln_1(x)
        # (B, T, C) -> (B, local heads, T, head_dim): a tensor-parallel rank holds heads / tp of them
        q, k, v = (p(h).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, width), nn.Embedding(seq, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, VOCAB, bias=False)
        for name, p in self.named_parameters():
            if p.dim() > 1:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            positions = torch.arange(idx.shape[1], device=idx.device)
            idx = self.wte(idx) + self.wpe(positions)
        for block in self.h:
            idx = block(idx)
        if self.ln_f is not None:
            idx = self.ln_f(idx)
        return self.lm_head(idx) if self.lm_head is not None else idx


def parallelize(model: GPT, tp_mesh) -> None:
    """Megatron's split of each block held here: q, k, v and fc by columns, proj and out by rows; the head by
    columns, its logits gathered. Embeddings, norms stay whole."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {name: ColwiseParallel() for name in ("q", "k", "v", "fc")}
    plan.update(proj=RowwiseParallel(), out=RowwiseParallel())
    for block in model.h:
        parallelize_module(block, tp_mesh, plan)
    if model.lm_head is not None:
        parallelize_module(model.lm_head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))


class LitGPT(L.LightningModule):
    def __init__(self, layers: int, width: int, heads: int, seq: int, batch: int, samples: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(layers, width, heads, seq)

    def configure_model(self) -> None:
        tp = self.device_mesh["tp"]
        if tp.size() > 1:
            parallelize(self.model, tp)

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
    """Wall-clock time of each optimizer step; this rank's state bytes at the last one (gradients present)."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.start = 0.0
        self.state: dict[str, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.start:
            self.start = time.perf_counter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        b = state_bytes(pl_module, trainer.optimizers)
        self.state = {"parameters": b.parameters, "gradients": b.gradients, "optimizer_state": b.optimizer_state}

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        now = time.perf_counter()
        self.steps.append(now - self.start)
        self.start = now


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0)
    pipeline_size, tensor_parallel, processes = LAYOUTS[args.layout]
    samples = args.global_batch * (args.steps + 1)
    model = LitGPT(args.layers, args.width, args.heads, args.seq, args.global_batch, samples)
    strategy = lightning_pipe.PipelineParallelStrategy(
        pipeline_size=pipeline_size, tensor_parallel=tensor_parallel, schedule="1F1B", microbatches=4
    )
    measure = Measure()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=processes,
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
        "saved": sum(strategy.memory_report.saved_per_microbatch.values()),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    Path(args.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def launch(args: argparse.Namespace, layout: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, "--worker", "--layout", layout, "--out", out]
        sizes = ("layers", "width", "heads", "seq", "global_batch", "steps")
        cmd += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in sizes]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    steps = ranks[0]["steps"][args.warmup :]
    return {
        "step": statistics.median(steps),
        "state": max(sum(r["state"].values()) for r in ranks),
        "parameters": max(r["state"]["parameters"] for r in ranks),
        "optimizer": max(r["state"]["optimizer_state"] for r in ranks),
        "saved": max(r["saved"] for r in ranks),
        "rss": max(r["peak_rss"] for r in ranks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8, help="samples per optimizer step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for layout in args.layouts.split(","):
        runs = [launch(args, layout) for _ in range(args.runs)]
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        steps = sorted(r["step"] for r in runs)
        rows.append((layout, median, steps))
        print(f"{layout}: {json.dumps(median)}", file=sys.stderr)
    print(
        "| (pp, tp), processes | step time, s (median of runs; min-max) | parameters | optimizer state |"
        " state, largest rank | saved for backward per microbatch | peak RSS, largest rank |"
    )
    print("|---|---|---|---|---|---|---|")
    for layout, m, steps in rows:
        pp, tp, processes = LAYOUTS[layout]
        print(
            f"| ({pp}, {tp}), {processes} | {m['step']:.3f} ({steps[0]:.3f}-{steps[-1]:.3f}) |"
            f" {format_bytes(m['parameters'])} | {format_bytes(m['optimizer'])} | {format_bytes(m['state'])} |"
            f" {format_bytes(m['saved'])} | {format_bytes(m['rss'])} |"
        )


if __name__ == "__main__":
    main()
