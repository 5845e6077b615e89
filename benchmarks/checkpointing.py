"""Activation checkpointing on a transformer stage: bytes saved for backward per microbatch, and the time it costs.

The stage: the middle blocks of a GPT (width 256, 4 heads) receiving hidden states of one microbatch, as a middle
pipeline stage does. For each setting (no checkpointing, every 2nd block, every block) it reports the bytes autograd
keeps for backward (:func:`lightning_pipe.measure.memory.saved_bytes`) and the forward+backward time (median of
``--repeats`` after a warm-up, this thread's CPU time by default; see ``benchmarks/balance.py`` for why).

Run from the repository root::

    python benchmarks/checkpointing.py      # --blocks 4 --batch 4 --seq 256 --width 256 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_pipe.measure.memory import format_bytes, saved_bytes  # noqa: E402
from lightning_pipe.models.units import find_layout  # noqa: E402
from lightning_pipe.parallel.activation_checkpointing import (  # noqa: E402
    apply_activation_checkpointing,
    remove_activation_checkpointing,
)
from lightning_pipe.split.partition import stage_units  # noqa: E402
from lightning_pipe.split.surgery import prune  # noqa: E402
from tests.gpt2 import GPT2  # noqa: E402


def step_time(stage: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, repeats: int, clock) -> list[float]:
    times = []
    for i in range(repeats + 1):
        h = x.clone().requires_grad_(True)
        start = clock()
        stage(h).backward(grad)
        if i:
            times.append(clock() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=4, help="blocks on the stage")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = parser.parse_args()
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT2(vocab=256, block_size=args.seq, n_layer=args.blocks + 2, n_head=4, n_embd=args.width)
    layout = find_layout(model)
    # A middle stage: all blocks but the first and the last, no embedding, no head.
    stage = prune(model, stage_units(layout, [1, args.blocks, 1])[1], layout.units)
    x = torch.randn(args.batch, args.seq, args.width)
    grad = torch.randn_like(x)
    print(
        f"middle stage of {args.blocks} GPT blocks, width {args.width}, microbatch {args.batch}x{args.seq} tokens,"
        f" {args.threads} thread(s), clock: {args.clock}, torch {torch.__version__}\n"
    )
    print(
        "| activation_checkpointing | saved for backward per microbatch | fewer than none |"
        " fwd+bwd, ms (median, min-max) | time vs none |"
    )
    print("|---|---|---|---|---|")
    base_bytes = base_time = None
    for every in (0, 2, 1):
        remove_activation_checkpointing(stage)
        apply_activation_checkpointing(stage, layout.blocks, every)
        n = saved_bytes(stage, (x.clone().requires_grad_(True),))
        times = step_time(stage, x, grad, args.repeats, clock)
        med = statistics.median(times)
        base_bytes, base_time = base_bytes or n, base_time or med
        label = {0: "False", 1: "True (every block)", 2: "2 (every 2nd block)"}[every]
        print(
            f"| {label} | {format_bytes(n)} | {base_bytes / n:.1f}x | {med * 1e3:.0f}"
            f" ({min(times) * 1e3:.0f}-{max(times) * 1e3:.0f}) | {100 * (med / base_time - 1):+.0f}% |"
        )


if __name__ == "__main__":
    main()
