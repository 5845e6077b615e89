"""The tuner's cost model: a candidate's step time and memory per rank, from measured unit costs.

What was measured (:mod:`lightning_pipe.tune.profile`, once, on one rank): each unit's forward, full backward and
input-gradient backward seconds on one microbatch of every candidate microbatch size, the bytes its forward saves for
backward, takes in and passes on, and its parameters (a :class:`Profile`). What the trials measured
(:class:`Calibration`, refitted after every trial): what an action costs beyond its compute, the last stage's loss
per sample, the transfer time of a message, what a step costs beyond its schedule (optimizer, Lightning's loop, data),
the optimizer state per parameter byte, the memory no unit accounts for, and what compiling the blocks saves.

A candidate's stages get their blocks as the strategy would split them (:func:`stage_blocks`), each stage's action
times are the sums of its units' (a checkpointed block runs its forward again in backward and keeps only its input),
and torch's action order of the candidate's schedule (a schedule of one's own: its given actions) is played out with
them (:func:`lightning_pipe.measure.simulate.simulate`): the step time, the bubble, and the activations each rank
holds at its peak.

Pure: numbers in, numbers out.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lightning_pipe.measure.profile import UnitTimes
from lightning_pipe.measure.simulate import StageTimes, schedule_orders, simulate
from lightning_pipe.models.units import Layout
from lightning_pipe.parallel.activation_checkpointing import checkpointed_blocks
from lightning_pipe.schedules.names import placement
from lightning_pipe.split.partition import (
    UnitCosts,
    balance_blocks,
    balance_by_cost,
    balance_step_time,
    check_balance,
    counts_from_split_points,
    stage_to_rank,
    stage_units,
)
from lightning_pipe.tune.layout import ProcessLayout, data_parallel_seconds, state_bytes, tensor_parallel_seconds
from lightning_pipe.tune.space import Candidate


@dataclass(frozen=True)
class Profile:
    """The network's units and what each costs at each microbatch size (samples per microbatch)."""

    layout: Layout
    params: Mapping[str, int]
    param_bytes: Mapping[str, int]
    times: Mapping[int, Mapping[str, UnitTimes]]
    #: samples per batch of one pipeline
    batch_size: int
    #: processes, and samples per step over all data-parallel replicas (for candidates that carry a layout; 0: the
    #: strategy's own layout only)
    world_size: int = 0
    global_batch: int = 0

    def pipeline_batch(self, candidate: Candidate) -> int:
        """Samples per batch of one pipeline under ``candidate``'s layout (the global batch over its replicas)."""
        if not candidate.pipeline_size:
            return self.batch_size
        return self.global_batch * candidate.pipeline_size * candidate.tensor_parallel // self.world_size

    def microbatch_size(self, candidate: Candidate) -> int:
        return self.pipeline_batch(candidate) // candidate.microbatches

    def at(self, microbatches: int, size: int | None = None) -> Mapping[str, UnitTimes]:
        """Unit times at ``size`` samples per microbatch (default: this profile's batch in ``microbatches``)."""
        size = self.batch_size // microbatches if size is None else size
        if size not in self.times:
            raise KeyError(f"microbatches of {size} samples were not profiled (profiled: {sorted(self.times)}).")
        return self.times[size]


@dataclass(frozen=True)
class BalanceRule:
    """How the strategy shares out the blocks (its ``split_points``/``balance``/``frontend`` settings)."""

    balance: str | tuple[int, ...] = "auto"
    split_points: tuple[str, ...] | None = None
    #: ``balance="auto"`` measures only when the LightningModule has ``example_input_array`` (else ``"params"``)
    has_example: bool = False
    traced: bool = False


def stage_blocks(
    profile: Profile, rule: BalanceRule, num_stages: int, microbatches: int, size: int | None = None
) -> list[int]:
    """Blocks per stage, as the strategy's split would give them (measured costs stand in for its own profiling).
    ``size``: samples per microbatch (default: the profile's batch in ``microbatches``)."""
    layout = profile.layout
    if rule.split_points is not None:
        return counts_from_split_points(layout.blocks, rule.split_points, num_stages)
    balance = "blocks" if rule.traced and isinstance(rule.balance, str) else rule.balance
    if not isinstance(balance, str):
        return check_balance(balance, len(layout.blocks), num_stages)
    if balance == "blocks":
        return balance_blocks(len(layout.blocks), num_stages)
    if balance == "params" or not rule.has_example:
        return balance_by_cost(_per_unit(layout, lambda u: float(profile.params[u])), num_stages)
    times = profile.at(microbatches, size)
    per_microbatch = _per_unit(layout, lambda u: times[u].forward + times[u].backward)
    return balance_step_time(per_microbatch, _per_unit(layout, lambda u: 0.0), num_stages, microbatches)


def _per_unit(layout: Layout, cost) -> UnitCosts:  # noqa: ANN001 - a function of a unit name
    return UnitCosts(
        pre=sum(cost(u) for u in layout.pre),
        blocks=tuple(cost(b) for b in layout.blocks),
        post=sum(cost(u) for u in layout.post),
    )


@dataclass(frozen=True)
class Calibration:
    """What the trials measured beyond the units' compute (see the module docstring). Zero until a trial ran."""

    action_overhead: float = 0.0
    step_overhead: float = 0.0
    loss_per_sample: float = 0.0
    latency: float = 0.0
    seconds_per_byte: float = 0.0
    #: gradient and optimizer-state bytes per parameter byte (1.0: a gradient and no state, as plain SGD)
    state_factor: float = 1.0
    memory_offset: float = 0.0
    #: compiled step time over eager step time, once a compiled trial and its eager twin were measured
    compile_factor: float | None = None
    #: ``(latency, seconds per byte)`` of one step of a ring all-gather or reduce-scatter over all processes
    collective: tuple[float, float] = (0.0, 0.0)
    #: the trials' forward and backward compute over the profile's (processes that share a machine compute slower
    #: than the profile's one process alone, and a backward that accumulates into existing gradients does more)
    compute_scale: tuple[float, float] = (1.0, 1.0)


@dataclass(frozen=True)
class Prediction:
    """A candidate's estimated step."""

    step: float
    bubble: float
    #: peak bytes of each pipeline rank: its stages' parameters, gradients and optimizer state, and the activations
    #: of the microbatches in flight at the worst moment
    memory: tuple[float, ...]
    blocks: tuple[int, ...] = field(default=())
    #: the simulated schedule's span alone (before the step's overhead)
    span: float = 0.0
    #: the layout's gradient synchronisation over data-parallel replicas, per step
    sync: float = 0.0

    @property
    def peak(self) -> float:
        return max(self.memory) if self.memory else 0.0


def stage_times(
    candidate: Candidate, profile: Profile, counts: Sequence[int], calibration: Calibration
) -> tuple[StageTimes, list[float], list[float]]:
    """The candidate's per-stage action times, and per stage the activation bytes of one microbatch and the bytes
    of its parameters."""
    size = profile.microbatch_size(candidate)
    times = profile.at(candidate.microbatches, size)
    layout = profile.layout
    tp = max(candidate.tensor_parallel, 1)
    recomputed = set(checkpointed_blocks(layout.blocks, candidate.activation_checkpointing))
    blocks = set(layout.blocks)
    forward, backward, backward_input, saved, params, transfer = [], [], [], [], [], []
    for units in stage_units(layout, counts):
        # Tensor parallelism: each process computes 1/tp of a block and all-reduces its output (forward and backward).
        sync = sum(
            tensor_parallel_seconds(calibration.collective, times[u].output_bytes, tp) for u in units if u in blocks
        )
        again = sum(times[u].forward for u in units if u in recomputed) / tp
        forward.append(sum(times[u].forward for u in units) / tp + sync)
        backward.append(sum(times[u].backward for u in units) / tp + again + sync)
        backward_input.append(sum(times[u].backward_input for u in units) / tp + again + sync)
        kept = [times[u].input_bytes if u in recomputed else times[u].saved_bytes / tp for u in units]
        # While a checkpointed block recomputes, its full activations exist once more.
        transient = max((times[u].saved_bytes / tp for u in units if u in recomputed), default=0)
        saved.append(float(sum(kept) + transient))
        params.append(float(sum(profile.param_bytes[u] for u in units)))
        out = times[units[-1]].output_bytes if units else 0
        transfer.append(calibration.latency + calibration.seconds_per_byte * out)
    weight = [max(b - i, 0.0) for b, i in zip(backward, backward_input)]
    ahead, behind = calibration.compute_scale
    stage = StageTimes(
        tuple(f * ahead for f in forward),
        tuple(b * behind for b in backward),
        tuple(i * behind for i in backward_input),
        tuple(w * behind for w in weight),
        loss=calibration.loss_per_sample * size,
        transfer=tuple(transfer[:-1]),
        overhead=calibration.action_overhead,
    )
    return stage, saved, params


def predict(
    candidate: Candidate, profile: Profile, rule: BalanceRule, pipeline_size: int, calibration: Calibration
) -> Prediction:
    """The candidate's estimated step time and memory per rank (``pipeline_size``: the strategy's own, for a
    candidate that carries no layout)."""
    pipeline_size = candidate.pipeline_size or pipeline_size
    num_stages = pipeline_size * candidate.stages_per_rank
    counts = stage_blocks(profile, rule, num_stages, candidate.microbatches, profile.microbatch_size(candidate))
    times, saved, params = stage_times(candidate, profile, counts, calibration)
    ranks = stage_to_rank(num_stages, pipeline_size, placement(candidate.schedule))
    orders = schedule_orders(candidate.schedule, pipeline_size, candidate.microbatches, candidate.stages_per_rank)
    sim = simulate(orders, times, ranks)
    held = [0.0] * pipeline_size
    for stage, nbytes in enumerate(params):
        held[ranks[stage]] += nbytes
    processes = ProcessLayout.of(candidate, profile.world_size) if candidate.pipeline_size else None
    sync = 0.0
    if processes is not None:
        # Every rank synchronises its own stages' gradients; the step waits for the slowest.
        local = [nbytes / processes.tensor_parallel for nbytes in held]
        sync = max(data_parallel_seconds(calibration.collective, b, processes.data_parallel_size) for b in local)
    step = sim.span + sync + calibration.step_overhead
    if candidate.compile and calibration.compile_factor is not None:
        step *= calibration.compile_factor
    activations = sim.peak_bytes(saved, ranks)
    state = [state_bytes(nbytes, calibration.state_factor, processes) for nbytes in held]
    memory = tuple(a + s + calibration.memory_offset for a, s in zip(activations, state))
    return Prediction(step, sim.bubble, memory, tuple(counts), sim.span, sync)


# -------------------------------------------------------------------------------------------------- calibration
@dataclass(frozen=True)
class Trial:
    """What one trial measured, as the calibration reads it."""

    candidate: Candidate
    #: median seconds per step
    step: float
    #: peak bytes of each pipeline rank
    memory: tuple[float, ...] = ()
    #: median seconds of each recorded action, by ``(stage, kind)`` (``kind``: F, B, W, L), when a timeline ran
    actions: Mapping[tuple[int, str], float] = field(default_factory=dict)
    #: gradient and optimizer-state bytes per parameter byte, when measured
    state_factor: float | None = None


def calibrate(
    profile: Profile,
    rule: BalanceRule,
    pipeline_size: int,
    trials: Sequence[Trial],
    transfer: tuple[float, float] = (0.0, 0.0),
    collective: tuple[float, float] = (0.0, 0.0),
) -> Calibration:
    """The calibration that makes the predictions of ``trials`` agree with their measurements (medians, so one odd
    trial does not move it much). ``transfer``: measured ``(latency, seconds per byte)`` of a message;
    ``collective``: of a step of a ring all-gather or reduce-scatter."""
    calibration = Calibration(latency=transfer[0], seconds_per_byte=transfer[1], collective=collective)
    timed = [t for t in trials if t.actions]
    if timed:
        calibration = _action_costs(profile, rule, pipeline_size, timed[0], calibration)
    factors = [t.state_factor for t in trials if t.state_factor is not None]
    if factors:
        calibration = dataclasses.replace(calibration, state_factor=statistics.median(factors))
    eager = [t for t in trials if not t.candidate.compile]
    if eager:
        modelled = [predict(t.candidate, profile, rule, pipeline_size, calibration) for t in eager]
        residual = [t.step - p.span - p.sync for t, p in zip(eager, modelled)]
        # Never below zero: what a step costs beyond its schedule is a cost. A negative median came from trials of
        # other layouts whose schedule the model overestimated (their groups' corrections take that up); taken as
        # is, it made every pipeline candidate's prediction negative on a wide MLP.
        calibration = dataclasses.replace(calibration, step_overhead=max(statistics.median(residual), 0.0))
    sized = [t for t in trials if t.memory]
    if sized:
        gaps = [max(t.memory) - predict(t.candidate, profile, rule, pipeline_size, calibration).peak for t in sized]
        calibration = dataclasses.replace(calibration, memory_offset=statistics.median(gaps))
    measured = {t.candidate: t.step for t in trials}
    ratios = [
        t.step / measured[t.candidate.eager] for t in trials if t.candidate.compile and t.candidate.eager in measured
    ]
    if ratios:
        calibration = dataclasses.replace(calibration, compile_factor=statistics.median(ratios))
    return calibration


def _action_costs(
    profile: Profile, rule: BalanceRule, pipeline_size: int, trial: Trial, calibration: Calibration
) -> Calibration:
    """Per-action overhead and loss per sample from one trial's recorded action times."""
    candidate = trial.candidate
    num_stages = (candidate.pipeline_size or pipeline_size) * candidate.stages_per_rank
    size = profile.microbatch_size(candidate)
    counts = stage_blocks(profile, rule, num_stages, candidate.microbatches, size)
    times, _, _ = stage_times(candidate, profile, counts, Calibration(collective=calibration.collective))
    split = any(kind == "W" for _, kind in trial.actions)
    modelled = {"F": times.forward, "B": times.backward_input if split else times.backward, "W": times.backward_weight}
    pairs = [
        (kind, seconds, modelled[kind][stage])
        for (stage, kind), seconds in trial.actions.items()
        if kind in modelled and stage < num_stages and modelled[kind][stage] > 0
    ]
    # What every action pays whatever its size (the smallest gap), and beyond it a factor on the compute of each
    # direction: a gap that grows with the compute is a slower compute, not an overhead that more (and smaller)
    # actions would pay again each (it made the model predict one microbatch of a V schedule at 1.6-2.4 times its
    # measured step).
    overhead = max(min((seconds - model for _, seconds, model in pairs), default=0.0), 0.0)

    def scale(kinds: str) -> float:
        found = [(seconds - overhead) / model for kind, seconds, model in pairs if kind in kinds]
        return max(statistics.median(found), 0.0) if found else 1.0

    loss = [seconds for (_, kind), seconds in trial.actions.items() if kind == "L"]
    return dataclasses.replace(
        calibration,
        action_overhead=overhead,
        loss_per_sample=statistics.median(loss) / size if loss else 0.0,
        compute_scale=(scale("F"), scale("BW")),
    )
