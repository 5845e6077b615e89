"""Does ``balance="auto"`` find a split as fast as the best one? A GPT with a heavy head, 2 and 4 stages.

The network: vocabulary 16,384, width 256, 8 blocks (the head is about five blocks' worth of work, the embedding
holds as many parameters as the head but costs little time). A stage's training work per step is measured for real,
in this one process: its forward on each of the ``M`` microbatches (the last stage adds the cross-entropy loss),
its backward on each, and an ``AdamW`` step. Every contiguous stage that any split can have is measured
(``--repeats`` times, median), so every split's stage times are known; a split's step time is then the makespan
of a GPipe schedule over those measured stage times (forward and backward per microbatch, then each stage's
optimizer step), and its bottleneck is its slowest stage's time per step. The exhaustive search takes the best
split over all of them; the auto split comes from :func:`lightning_pipe.split.balance.profile_units` on one microbatch.

Run from the repository root (about 8 minutes on one core)::

    python benchmarks/balance.py            # --stages 2 4 --microbatches 4 --batch 4 --seq 64 --repeats 5

Single-threaded by default (``--threads``), timed by this thread's CPU time (``--clock cpu``): on the shared
2-core reference machine, wall-clock times of identical stages varied by 2-4x under other processes' load, CPU
times by a few percent. One thread per process is also what a 2-process pipeline gets on 2 cores. On a quiet
machine ``--clock wall`` gives the same figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_pipe.models.units import Layout, find_layout  # noqa: E402
from lightning_pipe.split.balance import (  # noqa: E402
    CostModel,
    auto_balance,
    blocks_balance,
    measure_update_time,
    params_balance,
    profile_units,
    split_table,
)
from lightning_pipe.split.partition import all_splits  # noqa: E402
from lightning_pipe.split.surgery import stage_view  # noqa: E402
from tests.gpt2 import GPT2  # noqa: E402


@dataclass(frozen=True)
class StageTime:
    """Medians over repetitions, seconds: forward and backward per microbatch, optimizer step; and the spread."""

    forward: float
    backward: float
    update: float
    per_step: float
    spread: float  # (max - min) / median of the per-step times


def measure_stage(model: GPT2, layout: Layout, units: tuple[str, ...], first: bool, last: bool, args) -> StageTime:
    view = stage_view(model, units, layout.units)
    params = list(view.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.seq)
    tokens = [torch.randint(0, args.vocab, shape, generator=gen) for _ in range(args.microbatches)]
    hidden = [torch.randn(*shape, args.width, generator=gen) for _ in range(args.microbatches)]
    samples = []
    for rep in range(args.repeats + 1):
        inputs = tokens if first else [h.clone().requires_grad_(True) for h in hidden]
        t0 = args.clock()
        outs = []
        for m, x in enumerate(inputs):
            y = view(x)
            if last:
                y = F.cross_entropy(y.flatten(0, 1), tokens[m].flatten())
            outs.append(y)
        t1 = args.clock()
        for m, y in enumerate(outs):
            y.backward() if last else y.backward(hidden[m])
        t2 = args.clock()
        if params:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        t3 = args.clock()
        if rep:  # the first run is a warm-up (and creates the optimizer state)
            samples.append((t1 - t0, t2 - t1, t3 - t2))
        del outs, inputs
    per_step = [sum(s) for s in samples]
    med = statistics.median(per_step)
    return StageTime(
        forward=statistics.median(s[0] for s in samples) / args.microbatches,
        backward=statistics.median(s[1] for s in samples) / args.microbatches,
        update=statistics.median(s[2] for s in samples),
        per_step=med,
        spread=(max(per_step) - min(per_step)) / med,
    )


def gpipe_makespan(stages: list[StageTime], microbatches: int) -> float:
    """Step time of GPipe over measured stages: all forwards, all backwards, then each stage's optimizer step."""
    k, m = len(stages), microbatches
    fwd = [[0.0] * m for _ in range(k)]
    for s in range(k):
        for i in range(m):
            ready = max(fwd[s - 1][i] if s else 0.0, fwd[s][i - 1] if i else 0.0)
            fwd[s][i] = ready + stages[s].forward
    bwd = [[0.0] * m for _ in range(k)]
    for s in reversed(range(k)):
        for i in range(m):
            ready = max(bwd[s + 1][i] if s < k - 1 else 0.0, bwd[s][i - 1] if i else 0.0, fwd[s][m - 1])
            bwd[s][i] = ready + stages[s].backward
    return max(bwd[s][m - 1] + stages[s].update for s in range(k))


def segment_units(layout: Layout, i: int, j: int, first: bool, last: bool) -> tuple[str, ...]:
    return (layout.pre if first else ()) + layout.blocks[i:j] + (layout.post if last else ())


def stages_of(segments: dict[tuple[int, int, bool, bool], StageTime], counts: list[int]) -> list[StageTime]:
    k = len(counts)
    starts = [sum(counts[:s]) for s in range(k)]
    return [segments[(a, a + c, s == 0, s == k - 1)] for s, (a, c) in enumerate(zip(starts, counts))]


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT2(vocab=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width)
    layout = find_layout(model)
    n = len(layout.blocks)
    print(
        f"GPT: vocab {args.vocab}, width {args.width}, {n} blocks, {sum(p.numel() for p in model.parameters()):,}"
        f" parameters; {args.microbatches} microbatches of {args.batch}x{args.seq} tokens; {args.threads} thread(s);"
        f" clock: {'CPU time' if args.clock is time.thread_time else 'wall'};"
        f" torch {torch.__version__}\n"
    )

    # The auto split, as the strategy would compute it: profile one microbatch, then split.
    example = torch.randint(0, args.vocab, (args.batch, args.seq))
    start = time.perf_counter()
    profiles = profile_units(model, layout, (example,), {}, torch.device("cpu"), clock=args.clock)
    update = measure_update_time(torch.device("cpu"), clock=args.clock)
    profile_s = time.perf_counter() - start
    cost = CostModel(microbatches=args.microbatches, in_flight=args.microbatches, update_s_per_param=update)
    print(f"profiling pass: {profile_s:.2f} s")
    for p in profiles:
        if p.measured:
            print(f"  {p.name:8s} {p.time_s * 1e3:7.2f} ms fwd+bwd per microbatch, {p.params:>9,} parameters")

    segments: dict[tuple[int, int, bool, bool], StageTime] = {}
    max_k = max(args.stages)
    for i in range(n + 1):
        for j in range(i, n + 1):
            for first, last in ((True, False), (False, True), (False, False), (True, True)):
                if (first and i) or (last and j < n) or (i == j and not (first or last)):
                    continue
                if (first and last) or (max_k < 3 and not (first or last)):
                    continue
                units = segment_units(layout, i, j, first, last)
                segments[(i, j, first, last)] = measure_stage(model, layout, units, first, last, args)
    print(f"measured {len(segments)} stages\n")

    for k in args.stages:
        results = {}
        for counts in all_splits(n, k, first_min=0, last_min=0):
            st = stages_of(segments, counts)
            results[tuple(counts)] = (gpipe_makespan(st, args.microbatches), max(s.per_step for s in st), st)
        best = min(results, key=lambda c: results[c][0])
        auto = auto_balance(profiles, layout, k, cost)
        named = [
            ("auto", auto),
            ("blocks", blocks_balance(layout, k)),
            ("params", params_balance(model, layout, k)),
            ("best (exhaustive)", list(best)),
        ]
        print(f"### {k} stages ({len(results)} splits searched)\n")
        print("| split | blocks per stage | stage time per step, ms | bottleneck, ms | GPipe step, ms | vs best |")
        print("|---|---|---|---|---|---|")
        for label, counts in named:
            step, bottleneck, st = results[tuple(counts)]
            stage_ms = ", ".join(f"{s.per_step * 1e3:.0f} (±{s.spread * 50:.0f}%)" for s in st)
            print(
                f"| {label} | {counts} | {stage_ms} | {bottleneck * 1e3:.0f} | {step * 1e3:.0f} |"
                f" {100 * (step / results[best][0] - 1):+.1f}% |"
            )
        ranked = sorted(results, key=lambda c: results[c][0])
        print("\nfastest five:", ", ".join(f"{list(c)} {results[c][0] * 1e3:.0f} ms" for c in ranked[:5]))
        print("\nauto split as the strategy prints it:\n")
        print(split_table(layout, auto, profiles, cost))
        print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="sequences per microbatch")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="cpu: this thread's CPU time")
    args = parser.parse_args()
    args.clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    run(args)


if __name__ == "__main__":
    main()
