"""Runs a list of benchmark cases in one set of processes (started by ``torch.distributed.run``).

Usage: ``python -m torch.distributed.run --nproc-per-node K benchmarks/worker.py CASES_JSON OUT_JSONL``

Each case is a dict with a ``kind`` (below), a ``model`` (a key of :data:`benchmarks.common.MODELS`), ``steps`` and
``warmup``, and what its kind needs (``schedule``, ``microbatches``). Cases run in the order given, every process
running every case; global rank 0 appends one JSON line per case to ``OUT_JSONL`` (the case, its step times in ms
after the warm-up: wall-clock on rank 0, CPU time summed over the processes). The process group is
created once, by this script, and every Trainer reuses it.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import hand, lit, phase_timing  # noqa: E402
from benchmarks.common import MODELS, Clock, device_for, machine, periods_ms, pin_to_core  # noqa: E402
from benchmarks.lit import pipeline_strategy  # noqa: E402

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK")


@contextmanager
def alone() -> Iterator[None]:
    """Rank 0 runs a one-process case inside a multi-process launch (next to the cases it is compared with, while
    the other ranks wait in a barrier, using no CPU): Lightning must not see torchrun's environment meanwhile."""
    names = [k for k in os.environ if k in _LAUNCH_VARS or k.startswith(("TORCHELASTIC_", "ROLE_"))]
    saved = {k: os.environ.pop(k) for k in names}
    try:
        yield
    finally:
        os.environ.update(saved)


@contextmanager
def without_sigterm_broadcast() -> Iterator[None]:
    """Benchmark-only: skip the tensor broadcast Lightning's training loop makes at every step of any multi-process
    run (to agree on SIGTERM), to show how much of a step it takes. Not something to do in real training."""
    from lightning.pytorch.loops import training_epoch_loop

    loop = training_epoch_loop._TrainingEpochLoop
    original = loop._broadcast_sigterm_tensor
    loop._broadcast_sigterm_tensor = lambda self: None
    try:
        yield
    finally:
        loop._broadcast_sigterm_tensor = original


def run_case(case: dict[str, Any], rank: int, world: int, device: torch.device) -> tuple[Clock, dict[str, Any]]:
    """Run one case; return its clock and anything else it measured (on this rank)."""
    spec = MODELS[case["model"]]
    kind, steps = case["kind"], case["steps"] + case["warmup"]
    if kind == "hand":
        return hand.pipeline_loop(spec, case["schedule"], case["microbatches"], steps, rank, world, device), {}
    if kind == "single_hand":
        return hand.single_loop(spec, case["microbatches"], steps, device), {}
    if kind in ("strategy", "strategy_log"):
        return lit.fit(spec, pipeline_strategy(case), world, spec.batch, steps, log=kind == "strategy_log"), {}
    if kind == "strategy_nosigterm":
        with without_sigterm_broadcast():
            return lit.fit(spec, pipeline_strategy(case), world, spec.batch, steps), {}
    if kind == "timeline":
        from lightning_pipe.callbacks import PipelineTimeline

        timeline = PipelineTimeline(dirpath=case["dirpath"], trace_steps=case["trace_steps"], skip_steps=1)
        clock = lit.fit(spec, pipeline_strategy(case), world, spec.batch, steps, extra=[timeline])
        files = [str(f) for f in timeline.files]
        return clock, {"bubbles": timeline.bubbles, "theory": timeline.theory, "files": files}
    if kind == "ddp":
        return lit.fit(spec, "ddp", world, spec.batch // world, steps), {}
    if kind == "single_lightning":
        return lit.fit(spec, "auto", 1, spec.batch, steps), {}
    if kind == "eval_strategy":
        strategy = pipeline_strategy({**case, "microbatches": "auto"}, eval_microbatches=case["microbatches"])
        return lit.validate(spec, strategy, world, spec.batch, steps), {}
    if kind == "eval_single":
        return lit.validate(spec, "auto", 1, spec.batch, steps), {}
    if kind == "phases":
        return phase_timing.run_case(case, rank, world, device)
    raise ValueError(f"unknown case kind {kind!r}")


def main() -> None:
    cases, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    device = device_for(int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if any(case.get("pin") for case in cases):
        # each process on a core of its own, all its threads (gloo's, created later, inherit it)
        pin_to_core(int(os.environ.get("LOCAL_RANK", "0")))
    # Always a process group (of one process too): PipelineStage needs one, and every Trainer reuses it.
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    if rank == 0:
        with out.open("a") as f:
            f.write(json.dumps({"machine": machine(), "world_size": world}) + "\n")
    for case in cases:
        # A Lightning fit leaves its Trainer and module in reference cycles (about 45 MB a fit of the compute-bound
        # network, under the strategy and under Lightning's own single-device fit alike; the hand loop leaves none),
        # freed only by a full collection, which the collector's object counts seldom start: collected here, before
        # each case, so that garbage neither grows over a launch (11 GB after 243 rounds of the compute-bound pair)
        # nor is collected inside a later case's timed steps.
        gc.collect()
        if case.get("procs") == 1 and world > 1:
            if rank == 0:
                with alone():
                    clock, extra = run_case(case, 0, 1, device)
                record = {"case": case, "ms": periods_ms(clock.wall, case["warmup"]), **extra}
                record["cpu_ms"] = periods_ms(clock.cpu, case["warmup"])
                with out.open("a") as f:
                    f.write(json.dumps(record) + "\n")
            dist.barrier()
            continue
        try:
            clock, extra = run_case(case, rank, world, device)
        except Exception as err:  # a schedule that rejects a setting: recorded, the other cases go on
            if rank == 0:
                with out.open("a") as f:
                    f.write(json.dumps({"case": case, "error": f"{type(err).__name__}: {err}"}) + "\n")
            raise
        mine = {"wall": clock.wall, "cpu": clock.cpu}
        every = [mine] * world
        if world > 1:
            dist.all_gather_object(every, mine)
        if rank == 0:
            warmup = case["warmup"]
            record = {
                "case": case,
                # wall-clock step times of rank 0 (every rank of a pipeline runs at the same pace)
                "ms": periods_ms(clock.wall, warmup),
                # CPU time per step, summed over the processes
                "cpu_ms": [sum(t) for t in zip(*(periods_ms(r["cpu"], warmup) for r in every))],
                **extra,
            }
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
