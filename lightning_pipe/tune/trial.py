"""One trial: a candidate's settings on the real model and data for a few steps, in a Trainer of its own.

Each trial builds a quiet Trainer (no logger, checkpoints, progress bar, summary or validation) with the user's
Trainer's accelerator, devices, nodes, precision and gradient clipping and a :class:`PipelineParallelStrategy` of the
user's settings with the candidate's, and fits a deep copy of the user's LightningModule for ``warmup + steps``
steps (the user's model is never split or trained by the tuner). The first trial starts the processes, exactly as
``trainer.fit`` would; later trials reuse them and their process group. A :class:`Probe` callback stamps every
step's start (wall and CPU time), reads the peak memory, and in the first trial also records the schedule's actions
(the timeline), the optimizer-state size and the transfer time of a message between pipeline neighbours; at the
end every rank receives every rank's figures, so all ranks take the same decisions.
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_pipe.comm import collectives
from lightning_pipe.measure.memory import ProcessPeak, state_bytes
from lightning_pipe.measure.timeline import COMPUTE, Event, TimelineRecorder, action_durations
from lightning_pipe.microbatch import batch_size
from lightning_pipe.structures import map_tensors
from lightning_pipe.tune.noise import step_jitter
from lightning_pipe.tune.prune import Measured


@dataclass
class Measurement:
    """What one rank measured in a trial."""

    wall: list[int] = field(default_factory=list)
    cpu: list[int] = field(default_factory=list)
    peak: int | None = None
    pipeline_rank: int = 0
    #: every recorded action after the first step (first trial)
    actions: list[Event] = field(default_factory=list)
    #: gradient and optimizer-state bytes per parameter byte (first trial)
    state_factor: float | None = None
    #: ``(bytes, seconds)`` of messages to the next pipeline rank and back, halved (first trial, pipeline rank 0)
    transfers: list[tuple[int, float]] = field(default_factory=list)
    #: ``(gathered bytes, seconds)`` of all-gathers and reduce-scatters over all processes (first trial)
    collectives: list[tuple[int, float]] = field(default_factory=list)
    #: the strategy's resolved settings (pipeline rank 0 of the first trial)
    settings: Any = None
    #: the first batch, on the CPU (global rank 0 of the first trial)
    batch: Any = None
    #: samples in this rank's first batch
    samples: int = 0
    #: ``(host, cores the process may run on)`` (first trial; no cores where the OS does not say)
    placement: tuple[str, frozenset[int]] | None = None


class Probe(pl.Callback):
    """Measures a trial on this rank (see the module docstring); ``detail``: the first trial's extras."""

    def __init__(self, detail: bool) -> None:
        self.detail = detail
        self.mine = Measurement()
        self.everyone: list[Measurement] = []
        self._peak: ProcessPeak | None = None
        self._recorder: TimelineRecorder | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        self.mine.pipeline_rank = strategy.pipeline_rank
        self._peak = ProcessPeak(strategy.root_device)
        self._peak.reset()
        if self.detail:
            self._recorder = TimelineRecorder()
            strategy.runtime.attach_timeline(self._recorder)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._stamp(trainer)
        if self._recorder is not None:
            self._recorder.step = idx
        if idx == 0:
            self.mine.samples = batch_size(batch)
        if self.detail and idx == 0 and trainer.global_rank == 0:
            self.mine.batch = map_tensors(batch, lambda t: t.detach().cpu().clone())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stamp(trainer)
        strategy = trainer.strategy
        assert self._peak is not None
        self.mine.peak = self._peak.read()
        if self._recorder is not None:
            strategy.runtime.attach_timeline(None)
            # The first step also runs torch's shape inference.
            self.mine.actions = [e for e in self._recorder.take() if e.kind in COMPUTE and e.step >= 1]
            state = state_bytes(pl_module, trainer.optimizers)
            # Gradients as one more copy of the parameters: they may be freed between steps when this is read.
            self.mine.state_factor = 1.0 + state.optimizer_state / max(state.parameters, 1)
            self.mine.transfers = _transfer_times(strategy)
            self.mine.collectives = _collective_times(strategy.root_device)
            self.mine.settings = strategy.settings
            self.mine.placement = placement()
        self.everyone = collectives.all_gather_object(self.mine, collectives.world_group(), strategy.root_device)

    @staticmethod
    def _now(trainer: pl.Trainer) -> tuple[int, int]:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter_ns(), time.process_time_ns()

    def _stamp(self, trainer: pl.Trainer) -> None:
        wall, cpu = self._now(trainer)
        self.mine.wall.append(wall)
        self.mine.cpu.append(cpu)


def _transfer_times(strategy: Any) -> list[tuple[int, float]]:
    """Pipeline ranks 0 and 1 of each replica send messages of a few sizes back and forth; half a round trip each."""
    if strategy.pipeline_size < 2:
        return []
    group, rank, device = strategy.pipeline_group, strategy.pipeline_rank, strategy.root_device
    peers = collectives.group_ranks(group)
    out = []
    for numel in (1, 1 << 14, 1 << 18):
        buffer = torch.zeros(numel, device=collectives.served_device(group, device))
        rounds = []
        for _ in range(4):
            start = time.perf_counter()
            if rank == 0:
                collectives.wait([collectives.isend(buffer, peers[1], group)])
                collectives.recv_(buffer, peers[1], group)
            elif rank == 1:
                collectives.recv_(buffer, peers[0], group)
                collectives.wait([collectives.isend(buffer, peers[0], group)])
            rounds.append((time.perf_counter() - start) / 2)
        out.append((numel * buffer.element_size(), min(rounds[1:])))
    return out if rank == 0 else []


def _collective_times(device: torch.device) -> list[tuple[int, float]]:
    """Every process all-gathers and reduce-scatters a few sizes over all processes, as FSDP and data parallelism
    do: ``(gathered bytes, seconds)``, the fastest of three after a first (global rank 0 keeps them)."""
    group = collectives.world_group()
    ranks = collectives.group_size(group)
    if ranks < 2:
        return []
    out = []
    for numel in (ranks, ranks << 12, ranks << 16):
        full = torch.zeros(numel, device=device)
        shard = torch.zeros(numel // ranks, device=device)
        for gather in (True, False):
            rounds = []
            for _ in range(4):
                collectives.barrier(group, device)
                start = time.perf_counter()
                if gather:
                    collectives.all_gather_into_(full, shard, group)
                else:
                    collectives.reduce_scatter_(shard, full, group)
                rounds.append(time.perf_counter() - start)
            out.append((numel * full.element_size(), min(rounds[1:])))
    return out if collectives.world_rank() == 0 else []


def placement() -> tuple[str, frozenset[int]]:
    """This process's host and the cores it may run on (empty where the OS does not tell, e.g. macOS)."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    return socket.gethostname(), frozenset(cores)


def shared_cores(placements: list[tuple[str, frozenset[int]] | None]) -> list[tuple[int, int]]:
    """Pairs of ranks (indices of ``placements``) on one host whose cores overlap: the OS moves their threads
    between the shared cores, and a trial's speed then depends on where it put them."""
    out = []
    for a, first in enumerate(placements):
        for b in range(a + 1, len(placements)):
            second = placements[b]
            if first and second and first[0] == second[0] and first[1] & second[1]:
                out.append((a, b))
    return out


@dataclass(frozen=True)
class TrialSetup:
    """The user's Trainer's hardware and training settings that every trial Trainer copies."""

    accelerator: Any
    devices: int
    num_nodes: int
    precision: Any
    gradient_clip_val: Any
    gradient_clip_algorithm: Any
    plugins: tuple[Any, ...]

    @classmethod
    def of(cls, trainer: pl.Trainer) -> TrialSetup:
        strategy = trainer.strategy
        return cls(
            accelerator=type(trainer.accelerator)(),
            devices=trainer.num_devices,
            num_nodes=trainer.num_nodes,
            precision=trainer.precision,
            gradient_clip_val=trainer.gradient_clip_val,
            gradient_clip_algorithm=trainer.gradient_clip_algorithm,
            plugins=(strategy.cluster_environment,) if strategy.cluster_environment is not None else (),
        )


@dataclass(frozen=True)
class TrialResult:
    """Every rank's measurement of one trial, and the figures the tuner reads from them."""

    everyone: list[Measurement]
    warmup: int

    @property
    def first(self) -> Measurement:
        return self.everyone[0]

    def step_seconds(self) -> list[float]:
        """Wall seconds of each measured step (global rank 0; every rank of a pipeline runs at the same pace)."""
        stamps = self.first.wall
        return [(b - a) / 1e9 for a, b in zip(stamps, stamps[1:])][self.warmup :]

    def cpu_seconds(self) -> list[float]:
        """CPU seconds of each measured step, summed over every process."""
        per_rank = [[(b - a) / 1e9 for a, b in zip(m.cpu, m.cpu[1:])][self.warmup :] for m in self.everyone]
        return [sum(step) for step in zip(*per_rank)]

    def peaks(self, pipeline_size: int) -> tuple[float, ...]:
        """Peak bytes of each pipeline rank (the worst of its replicas); empty when unknown."""
        if any(m.peak is None for m in self.everyone):
            return ()
        out = [0.0] * pipeline_size
        for m in self.everyone:
            out[m.pipeline_rank] = max(out[m.pipeline_rank], float(m.peak))  # type: ignore[arg-type]
        return tuple(out)

    def action_medians(self) -> dict[tuple[int, str], float]:
        """Median seconds of each recorded ``(stage, kind)`` action, over every rank."""
        return action_durations(e for m in self.everyone for e in m.actions)

    def microbatches(self) -> int:
        """Microbatches the strategy ran per step (from the recorded forwards of stage 0)."""
        return len({e.microbatch for m in self.everyone for e in m.actions if e.stage == 0 and e.kind == "F"})

    def transfer(self) -> tuple[float, float]:
        """``(latency, seconds per byte)`` of a message between pipeline neighbours (least squares)."""
        return _line([p for m in self.everyone for p in m.transfers])

    def collective(self) -> tuple[float, float]:
        """``(latency, seconds per byte)`` of one step of a ring all-gather or reduce-scatter over all processes:
        each measured collective of ``B`` gathered bytes over ``n`` processes is ``n - 1`` steps of ``B / n`` bytes
        (least squares)."""
        ranks = len(self.everyone)
        points = [(b / ranks, s / (ranks - 1)) for m in self.everyone for b, s in m.collectives]
        return _line(points)

    def batch_size(self) -> int:
        return batch_size(self.first.batch)

    def shared_cores(self) -> list[tuple[int, int]]:
        """Pairs of global ranks that share CPU cores (first trial)."""
        return shared_cores([m.placement for m in self.everyone])


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``(intercept, slope)`` of the least-squares line through ``(bytes, seconds)`` points, neither below 0."""
    if len(points) < 2:
        return 0.0, 0.0
    xs, ys = [float(b) for b, _ in points], [s for _, s in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-30)
    return max(my - slope * mx, 0.0), max(slope, 0.0)


@contextmanager
def _quiet() -> Iterator[None]:
    """Lightning's and the strategy's information lines (the split, memory, "stopped") once per trial would bury
    the tuner's table: warnings and errors only, while a trial runs."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_trial(
    setup: TrialSetup,
    make_strategy: Callable[[], Any],
    model: pl.LightningModule,
    fit_kwargs: dict[str, Any],
    steps: int,
    warmup: int,
    detail: bool,
) -> TrialResult:
    """Fit a copy of ``model`` with a new strategy from ``make_strategy`` for ``warmup + steps`` steps; every rank's
    measurements. The strategy is made here so that nothing outside the trial holds it (a finished strategy keeps its
    model, as Lightning's do)."""
    probe = Probe(detail)
    with _quiet(), tempfile.TemporaryDirectory(prefix="lightning-pipe-tune-") as root:
        trainer = pl.Trainer(
            accelerator=setup.accelerator,
            devices=setup.devices,
            num_nodes=setup.num_nodes,
            precision=setup.precision,
            strategy=make_strategy(),
            plugins=list(setup.plugins),
            max_steps=warmup + steps,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            gradient_clip_val=setup.gradient_clip_val,
            gradient_clip_algorithm=setup.gradient_clip_algorithm,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[probe],
            default_root_dir=root,
        )
        trainer.fit(copy.deepcopy(model), **fit_kwargs)
    everyone = probe.everyone
    # A finished Trainer, its strategy, model copy and data are reference cycles that only a full collection frees:
    # left to the collector's thresholds, every earlier trial's memory was still held when the next one measured its
    # peak (the mlp benchmark's peaks grew 0.85 -> 3.8 GiB over 11 trials).
    del trainer, probe
    gc.collect()
    return TrialResult(everyone, warmup)


def measured_of(trials: list[TrialResult]) -> Measured:
    """One candidate's trials: the geometric mean of their median steps, the median CPU time of all their steps,
    the highest peak, each trial's median and spread."""
    medians = tuple(statistics.median(trial.step_seconds()) for trial in trials)
    jitter = tuple(step_jitter(trial.step_seconds()) for trial in trials)
    cpu = [s for trial in trials for s in trial.cpu_seconds()]
    peaks = [m.peak for trial in trials for m in trial.everyone if m.peak is not None]
    return Measured(
        math.exp(statistics.fmean(math.log(m) for m in medians)),
        statistics.median(cpu) if cpu else 0.0,
        float(max(peaks, default=0)),
        sum(len(trial.step_seconds()) for trial in trials),
        len(trials),
        medians,
        jitter,
    )


def shared_cores_note(pairs: list[tuple[int, int]]) -> str:
    shown = ", ".join(f"{a} and {b}" for a, b in pairs[:3]) + (
        f" (and {len(pairs) - 3} more pairs)" if len(pairs) > 3 else ""
    )
    return (
        f"Processes of ranks {shown} may run on the same CPU cores. The OS moves their threads between the cores"
        " they share, and a trial's speed then depends on where it put them as much as on the setting: on a 2-core"
        " machine, the same setting measured up to 1.45x apart from one trial to the next. Pin each process to cores"
        " of its own (`os.sched_setaffinity`, `taskset`, `numactl`; docs/tuning.md) and tune again (`retune=True`)."
    )
