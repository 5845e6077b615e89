"""The phases suite inside the worker processes: the entry points of :data:`PHASES` timed, and the trainings.

How a phase is timed, and what the trainings are: :mod:`benchmarks.phases`, which plans the rounds, runs them in a
launch of benchmarks/worker.py, summarises them and writes their docs blocks. What runs in each process of that
launch is here (:func:`run_case`).
"""

from __future__ import annotations

import functools
import importlib
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

LOOP = "loop and hooks"
COMM = "communication (activations, gradients)"
GRADS = "gradients (hand-over, sync, scale, clip)"
THREADS = "communication threads"
#: the network's own compute: the same torch code under both loops (the stage modules' forward and backward)
COMPUTE_PHASES = ("stage forward", "stage backward")

#: (module, qualified name of a function or method, phase). Order of the table.
PHASES: list[tuple[str, str, str]] = [
    ("torch.utils.data.dataloader", "_BaseDataLoaderIter.__next__", "data"),
    ("lightning.pytorch.strategies.strategy", "Strategy.batch_to_device", "data"),
    ("torch.distributed.pipelining.schedules", "_PipelineSchedule._split_inputs", "microbatch split"),
    ("lightning_pipe.step.protocol", "split_batch", "microbatch split"),
    ("lightning_pipe.step.protocol", "StepProtocol._capture", "capture (the user's step up to the network call)"),
    ("torch.distributed.pipelining.stage", "_PipelineStageBase.forward_one_chunk", "stage forward"),
    ("torch.distributed.pipelining.stage", "_PipelineStageBase.backward_one_chunk", "stage backward"),
    ("torch.distributed.pipelining.schedules", "_PipelineSchedule._compute_loss", "loss (last stage)"),
    ("torch.distributed.pipelining.schedules", "_batch_p2p", COMM),
    ("torch.distributed.pipelining.schedules", "_wait_batch_p2p", COMM),
    ("torch.distributed.pipelining.stage", "_PipelineStageBase.get_fwd_recv_ops", COMM),
    ("torch.distributed.pipelining.stage", "_PipelineStageBase.get_bwd_recv_ops", COMM),
    ("torch.distributed.pipelining.stage", "_PipelineStageBase.get_fwd_send_ops", COMM),
    ("torch.distributed.pipelining.stage", "_PipelineStageBase.get_bwd_send_ops", COMM),
    ("torch.distributed.pipelining.schedules", "Schedule1F1B._step_microbatches", "torch schedule (its own Python)"),
    ("torch.distributed.pipelining.schedules", "PipelineScheduleSingle.step", "torch schedule (its own Python)"),
    ("lightning_pipe.step.protocol", "StepProtocol._settle", "settle and replay (loss, logs, metrics)"),
    ("lightning_pipe.step.protocol", "StepProtocol._replay", "settle and replay (loss, logs, metrics)"),
    ("lightning_pipe.step.protocol", "StepProtocol._portable", "settle and replay (loss, logs, metrics)"),
    ("lightning_pipe.step.sharing", "OutcomeChannel.expect", "outcome exchange (last stage -> every rank)"),
    ("lightning_pipe.step.sharing", "OutcomeChannel.share", "outcome exchange (last stage -> every rank)"),
    ("lightning_pipe.step.protocol", "StepProtocol._check_agreement", "outcome exchange (last stage -> every rank)"),
    ("lightning_pipe.step.protocol", "StepProtocol.run", "strategy step glue (protocol, executor)"),
    ("lightning_pipe.step.executors.schedule", "ScheduleExecutor.run", "strategy step glue (protocol, executor)"),
    ("torch.distributed.pipelining.stage", "_PipelineStageBase.scale_grads", GRADS),
    ("lightning_pipe.parallel.grads", "GradientStash.capture", GRADS),
    ("lightning_pipe.parallel.grads", "GradientStash.apply", GRADS),
    ("lightning_pipe.parallel.grads", "GradientSync.synchronize", GRADS),
    ("lightning_pipe.parallel.grads", "StageGradients.clip", GRADS),
    ("torch.optim.sgd", "SGD.step", "optimizer (step, zero_grad)"),
    ("torch.optim.optimizer", "Optimizer.zero_grad", "optimizer (step, zero_grad)"),
    # Lightning runs training_step, backward and its clipping hooks inside optimizer.step's closure: charged to the
    # loop (or the phases timed inside), not to the optimizer
    ("lightning.pytorch.plugins.precision.precision", "Precision._wrap_closure", LOOP),
    (
        "lightning.pytorch.loops.training_epoch_loop",
        "_TrainingEpochLoop._broadcast_sigterm_tensor",
        "Lightning's per-step collective (SIGTERM broadcast)",
    ),
]


def phase_names() -> list[str]:
    names: list[str] = []
    for _, _, phase in PHASES:
        if phase not in names and phase != LOOP:
            names.append(phase)
    return [*names, LOOP, THREADS]


class PhaseTimer:
    """Main-thread CPU time per phase, exclusive of nested timed calls, collected step by step."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}
        self.steps: list[dict[str, int]] = []
        # [phase, start, time of nested timed calls] of the calls in progress
        self._stack: list[list[Any]] = []
        self._mark: tuple[int, int] | None = None

    def wrap(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        clock, stack, totals = time.thread_time_ns, self._stack, self.totals

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [phase, clock(), 0]
            stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - frame[1]
                stack.pop()
                totals[phase] = totals.get(phase, 0) + elapsed - frame[2]
                if stack:
                    stack[-1][2] += elapsed

        return timed

    def tick(self) -> None:
        """A step boundary (the benchmark clock's stamp): close the step that ends here."""
        now = (time.thread_time_ns(), time.process_time_ns())
        if self._mark is not None:
            thread, process = now[0] - self._mark[0], now[1] - self._mark[1]
            step = dict(self.totals)
            step[LOOP] = thread - sum(step.values())
            step[THREADS] = process - thread
            self.steps.append(step)
        self.totals.clear()
        self._mark = now


@contextmanager
def timed_phases(timer: PhaseTimer, clock_ticks: bool = True) -> Iterator[None]:
    """Every entry point of :data:`PHASES` wrapped, and the benchmark clock's stamps made step boundaries (unless
    ``clock_ticks`` is false: the caller calls ``timer.tick()`` itself)."""
    undo: list[tuple[Any, str, Any]] = []
    targets = [(m, q, p) for m, q, p in PHASES]
    if clock_ticks:
        targets.append(("benchmarks.common", "Clock.tick", None))
    try:
        for module_name, qualname, phase in targets:
            owner: Any = importlib.import_module(module_name)
            *path, attr = qualname.split(".")
            for part in path:
                owner = getattr(owner, part)
            original = owner.__dict__[attr]
            if phase is None:

                def tick(self: Any, _tick: Callable[..., Any] = original) -> None:
                    _tick(self)
                    timer.tick()

                setattr(owner, attr, tick)
            else:
                setattr(owner, attr, timer.wrap(original, phase))
            undo.append((owner, attr, original))
        yield
    finally:
        for owner, attr, original in reversed(undo):
            setattr(owner, attr, original)


def run_case(case: dict[str, Any], rank: int, world: int, device: Any) -> tuple[Any, dict[str, Any]]:
    """One training of ``case["of"]`` (``"hand"`` or ``"strategy"``), phases timed when ``case["phased"]``; on rank
    0 the per-step phases summed over the ranks."""
    import torch.distributed as dist

    from benchmarks import hand, lit
    from benchmarks.common import MODELS
    from benchmarks.lit import pipeline_strategy

    spec = MODELS[case["model"]]
    steps = case["steps"] + case["warmup"]

    if case["of"] == "interleaved":
        return interleaved(spec, case, steps, rank, world, device)

    def train() -> Any:
        if case["of"] == "hand":
            return hand.pipeline_loop(spec, case["schedule"], case["microbatches"], steps, rank, world, device)
        return lit.fit(spec, pipeline_strategy(case), world, spec.batch, steps)

    if not case["phased"]:
        return train(), {"load": load_average()}
    timer = PhaseTimer()
    with timed_phases(timer):
        clock = train()
    mine = timer.steps[case["warmup"] :]
    every = [mine] * world
    if world > 1:
        dist.all_gather_object(every, mine)
    summed = [{k: sum(r[i].get(k, 0) for r in every) / 1e6 for k in phase_names()} for i in range(len(mine))]
    return clock, {"phases": summed, "load": load_average()}


def interleaved(spec: Any, case: dict[str, Any], steps: int, rank: int, world: int, device: Any) -> tuple[Any, dict]:
    """One strategy training in which a callback runs one step of the hand loop (its own network, stages, schedule,
    optimizer and DataLoader) as each of the strategy's steps starts: the two loops alternate step by step in the
    same processes, so a step of each is timed within the same second (with ``case["floor"]``, the training is
    Lightning's loop driving a second hand pipeline: :class:`benchmarks.lit.HandModule`). The hand step is timed from
    its start to its end (its batch's fetch included); the strategy's from the end of one hand step to the start of
    the next, that is the rest of Lightning's iteration (its fetch, hooks, the strategy's step). On rank 0: the
    per-step times of both, wall clock of rank 0 and CPU time summed over the ranks, warm-up steps dropped."""
    import lightning.pytorch as L
    import torch.distributed as dist

    from benchmarks import hand, lit
    from benchmarks.common import Clock, dataset, loader
    from benchmarks.lit import pipeline_strategy

    pipeline = hand.HandPipeline(spec, case["schedule"], case["microbatches"], rank, world, device)
    batches = iter(loader(dataset(spec, steps), spec.batch))
    starts, ends = Clock(device), Clock(device)
    timer = PhaseTimer() if case["phased"] else None

    def stamp(clock: Clock) -> None:
        clock.tick()
        if timer is not None:  # every stamp closes a step: a hand step, then a strategy step, and so on
            timer.tick()

    class HandAlongside(L.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            stamp(starts)
            pipeline.step(*next(batches))
            stamp(ends)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            stamp(starts)

    with timed_phases(timer, clock_ticks=False) if timer is not None else nullcontext():
        if case.get("floor"):  # Lightning's loop driving a second hand pipeline, in place of the strategy
            clock = lit.fit_hand(spec, case["schedule"], case["microbatches"], world, steps, extra=[HandAlongside()])
        else:
            clock = lit.fit(spec, pipeline_strategy(case), world, spec.batch, steps, extra=[HandAlongside()])
    warmup = case["warmup"]

    def periods(field: str) -> dict[str, list[float]]:
        a, b = getattr(starts, field), getattr(ends, field)
        hand_ms = [(e - s) / 1e6 for s, e in zip(a, b)][warmup:]
        strategy_ms = [(s - e) / 1e6 for e, s in zip(b, a[1:])][warmup:]
        return {"hand": hand_ms, "strategy": strategy_ms}

    mine: dict[str, Any] = {"cpu": periods("cpu")}
    if timer is not None:
        mine["phases"] = {"hand": timer.steps[0::2][warmup:], "strategy": timer.steps[1::2][warmup:]}
    every = [mine] * world
    if world > 1:
        dist.all_gather_object(every, mine)
    cpu = {of: [sum(v) for v in zip(*(r["cpu"][of] for r in every))] for of in ("hand", "strategy")}
    extra: dict[str, Any] = {"steps_ms": periods("wall"), "steps_cpu_ms": cpu, "load": load_average()}
    if timer is not None:
        extra["phases"] = {
            of: [{k: sum(r["phases"][of][i].get(k, 0) for r in every) / 1e6 for k in phase_names()} for i in range(n)]
            for of in ("hand", "strategy")
            for n in [min(len(r["phases"][of]) for r in every)]
        }
    return clock, extra


def load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None
