"""``lightning_pipe.tune(trainer, model, datamodule=...)``: choose the strategy's settings by measuring them.

Like Lightning's ``Tuner(trainer).scale_batch_size(model)``, it runs before ``trainer.fit`` and leaves the Trainer
set up with its choice. The steps (docs/tuning.md):

1. A record of an earlier tuning with the same fingerprint (model, hyperparameters, world, device, precision, torch,
   search space, memory limit) is reused: no trial runs.
2. The first trial runs the user's own settings (the processes start here, as ``fit`` would start them) and also
   records the schedule's actions, the optimizer state and the message time between pipeline neighbours.
3. Global rank 0 profiles every unit of the network at every candidate microbatch size (:mod:`.profile`); every
   rank receives the profile.
4. Until ``max_trials`` trials ran, or no candidate is predicted within ``margin`` of the best measured one: the
   cost model is refitted to the trials so far (:func:`.cost.calibrate`), every candidate is predicted
   (:func:`.cost.predict`) and the predictions corrected by what similar candidates measured
   (:func:`.prune.corrected`); the fastest predicted within the memory limit is measured, a candidate unlike all
   measured ones first (:func:`.prune.next_trial`).
5. The measured candidates whose step lies within the measured noise of the fastest one's are measured again with
   it, in rounds of one trial each, until none is left within the noise or ``confirm`` more trials ran
   (:func:`.prune.repeat_round`, :mod:`.noise`).
6. The fastest measured candidate within the memory limit wins (the geometric mean of its trials' median steps),
   with how sure it is against the closest other (:func:`.prune.how_sure`); the table is printed on rank 0, the
   record and a LightningCLI config are written, and the choice is applied to ``trainer.strategy``.

The random number generators of every process are restored afterwards, so tuning changes nothing the run draws.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from lightning_pipe.comm import collectives
from lightning_pipe.errors import PipelineConfigError, PipelineModelError, PipelineUsageError
from lightning_pipe.measure.memory import device_memory, format_bytes
from lightning_pipe.schedules.custom import CustomSchedule
from lightning_pipe.split.builder import is_split
from lightning_pipe.tune import prune, record
from lightning_pipe.tune.cost import BalanceRule, Profile, Trial, calibrate, predict
from lightning_pipe.tune.layout import BATCH_ATTRIBUTE, BatchKnob, ProcessLayout, find_batch_knob, layouts
from lightning_pipe.tune.noise import Sureness
from lightning_pipe.tune.profile import profile_network
from lightning_pipe.tune.space import Candidate, SearchSpace, candidates, from_settings
from lightning_pipe.tune.trial import TrialResult, TrialSetup, measured_of, run_trial, shared_cores_note

log = logging.getLogger("lightning.pytorch.lightning_pipe")


@dataclass(frozen=True)
class TuneResult:
    """What :func:`tune` chose and why."""

    choice: Candidate
    #: the strategy arguments applied to ``trainer.strategy``
    settings: dict[str, Any]
    table: str
    #: every candidate, with its prediction, measurement and status (empty when the choice was reused)
    rows: tuple[prune.Row, ...]
    #: the tuning's own cost (global rank 0's clock): ``wall_s``; ``launch_s`` (of it, until the first trial's first
    #: step: starting the processes, which ``fit`` does anyway when nothing is tuned, and the first split);
    #: ``cpu_s`` (all processes); ``trials`` (repeated trials included); ``repeated``; ``measured`` (candidates);
    #: ``steps``; ``profile_s``; ``step_s`` (the choice's step time); ``in_steps`` (``wall_s - launch_s`` in steps of
    #: the choice); ``candidates``
    cost: dict[str, float]
    #: the record and the LightningCLI config written (or read)
    files: tuple[Path, ...]
    reused: bool
    #: what made the trials less reliable than they could be, and the fix; layouts left out, and why (also in the
    #: logged summary)
    notes: tuple[str, ...] = ()
    #: the per-replica batch size set on the LightningModule or DataModule when the chosen layout has another
    #: data-parallel size than the strategy had (the global batch stays the same); ``None``: unchanged
    batch_size: Optional[int] = None
    #: how sure the choice is against the closest other measured candidate (:meth:`.noise.Sureness.as_dict`: its
    #: ``rival``, the ``ratio`` of their steps and its 95% ``interval``, the ``probability`` that the choice is the
    #: faster, the trial ``noise``, and whether the rival is still ``within_noise``; empty in older records)
    sureness: dict[str, Any] = dataclasses.field(default_factory=dict)


def tune(
    trainer: Any,
    model: Any,
    datamodule: Any = None,
    train_dataloaders: Any = None,
    *,
    space: Optional[SearchSpace] = None,
    steps: int = 5,
    warmup_steps: int = 2,
    max_trials: int = 8,
    margin: float = 0.1,
    confirm: int = 6,
    memory_limit: Optional[Union[int, float]] = None,
    path: Optional[Union[str, Path]] = None,
    retune: bool = False,
) -> TuneResult:
    """Choose ``schedule``, ``microbatches``, ``stages_per_rank``, ``activation_checkpointing`` (and ``compile``) for
    ``trainer``'s pipeline strategy by measuring them on ``model`` and its training data; apply the choice.

    Arguments:
        trainer: A Trainer whose strategy is ``PipelineParallelStrategy`` (``strategy="pipeline"``), not yet fitted.
        model: The LightningModule (not changed: trials train copies of it).
        datamodule: The training data's LightningDataModule, as for ``trainer.fit`` (default: the model's own data).
        train_dataloaders: Or the training loaders, as for ``trainer.fit``.
        space: The candidates (:class:`SearchSpace`). Default: every schedule, the divisors of the batch size from
            the pipeline size up, 2 stages per rank for the multi-stage schedules, with and without activation
            checkpointing, not compiled, the strategy's own layout. ``SearchSpace(pipeline_sizes="auto",
            data_parallel=("ddp", "fsdp"))`` also searches how the processes split into pipeline and data
            parallelism, pipeline size 1 (no pipeline) included (docs/tuning.md). A strategy given a schedule of
            its own keeps it: the space's schedules, microbatches and stages per rank give way to it.
        steps: Steps measured per trial (the median counts), after ``warmup_steps`` steps that do not.
        max_trials: Most trials of different candidates, the user's own settings included. With ``confirm``,
            ``steps`` and ``warmup_steps`` it bounds the tuning's cost: at most ``(max_trials + confirm) * (steps +
            warmup_steps)`` training steps plus one profiling pass.
        margin: A candidate is measured only if predicted within this fraction of the prediction for the fastest
            candidate measured so far (twice this fraction when nothing like it was measured yet); measured
            candidates within this fraction of the fastest are finalists.
        confirm: Most trials that measure again the candidates within the measured noise of the fastest (0:
            none; docs/tuning.md).
        memory_limit: Bytes per process that no choice may exceed. Default: the GPU's memory, or on the CPU the
            machine's divided among its processes. On the CPU the peak resident set is measured.
        path: Where the record (``.json``) and the LightningCLI config (``.yaml``) go. Default:
            ``<trainer.default_root_dir>/pipeline_tune``.
        retune: Tune even if a record for the same fingerprint exists.
    """
    strategy = trainer.strategy
    if not callable(getattr(strategy, "apply_tuned", None)):
        raise PipelineConfigError(
            f"`tune` chooses the settings of PipelineParallelStrategy, but the Trainer's strategy is"
            f" {type(strategy).__name__}. Use `Trainer(strategy='pipeline')` or a PipelineParallelStrategy."
        )
    if is_split(model):
        raise PipelineUsageError(
            "This LightningModule was already split by a fit; `tune` needs the whole model. Call `tune` before"
            " `trainer.fit`, on a new LightningModule instance."
        )
    _check_budget(steps, warmup_steps, max_trials, confirm, margin, memory_limit)
    space = space or SearchSpace()
    settings = strategy.settings
    if isinstance(settings.schedule, CustomSchedule):
        # The schedule is the user's: tune what it leaves open (checkpointing, compile, the layout).
        space = dataclasses.replace(space, schedules=(settings.schedule,))
    target = Path(path) if path is not None else Path(trainer.default_root_dir) / "pipeline_tune"
    # A DataLoader passed built cannot take another batch size.
    knob = find_batch_knob(model, datamodule) if space.searches_layout and train_dataloaders is None else None
    facts = _facts(trainer, model, datamodule, space, memory_limit, knob)
    expected = record.fingerprint(facts)
    if not retune:
        found = record.load(target, expected)
        if found is not None:
            strategy.apply_tuned(**found.settings)
            size = found.batch.get("batch_size")
            if size is not None and knob is not None:
                knob.set(size)
            _announce(f"Pipeline tuning: reusing the choice in {record.paths(target)[0]}: {found.choice.label}.")
            return TuneResult(
                found.choice, found.settings, found.table, (), found.cost, record.paths(target), True, (), size,
                found.sureness,
            )  # fmt: skip
    fit_kwargs = {"datamodule": datamodule} if datamodule is not None else {"train_dataloaders": train_dataloaders}
    with _kept_random_state():
        result = _search(
            trainer, model, fit_kwargs, space, (steps, warmup_steps, max_trials, confirm), margin, memory_limit, knob
        )
    choice, rows, cost, notes, size, sure = result
    applied = _applied(choice, settings)
    table = prune.table(rows)
    files = record.paths(target)
    batch = {"section": knob.section, "batch_size": size} if knob is not None and size is not None else {}
    if collectives.world_rank() == 0:
        files = record.save(
            record.TuneRecord(expected, choice, facts, table, cost, applied, batch, sure.as_dict()), target
        )
    _announce(_summary(choice, table, cost, files[1], notes, sure))
    strategy.apply_tuned(**applied)
    if knob is not None and size is not None:
        knob.set(size)
    return TuneResult(choice, applied, table, tuple(rows), cost, files, False, notes, size, sure.as_dict())


def _search(
    trainer: Any,
    model: Any,
    fit_kwargs: dict[str, Any],
    space: SearchSpace,
    budget: tuple[int, int, int, int],
    margin: float,
    memory_limit: Optional[float],
    knob: Optional[BatchKnob],
) -> tuple[Candidate, list[prune.Row], dict[str, float], tuple[str, ...], Optional[int], Sureness]:
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    steps, warmup, max_trials, confirm = budget
    strategy = trainer.strategy
    setup = TrialSetup.of(trainer)
    settings = strategy.settings
    first = run_trial(setup, functools.partial(_strategy, strategy, {}), model, fit_kwargs, steps, warmup, detail=True)
    resolved = next(m.settings for m in first.everyone if m.settings is not None)
    pipeline_size = int(resolved.pipeline_size)
    baseline = from_settings(resolved, first.microbatches())
    batch = first.batch_size()
    device = strategy.root_device
    # Rank 0's machine decides for all: every rank must take the same decisions.
    limit = memory_limit if memory_limit is not None else device_memory(device, setup.devices)
    limit = collectives.broadcast_object(limit, 0, collectives.world_group(), device)
    search = _layout_search(model, settings, space, resolved, batch, knob) if space.searches_layout else None
    space = search.space if search is not None else space
    if search is not None:
        baseline = search.own.carried_by(baseline)
    profile_start = time.perf_counter()
    sizes = search.sizes(space) if search is not None else set()
    profile = _profile(model, settings, first, space, pipeline_size, baseline, device, sizes)
    profile_s = time.perf_counter() - profile_start
    if search is not None:
        profile = dataclasses.replace(profile, world_size=search.world_size, global_batch=search.global_batch)
    rule = BalanceRule(
        settings.balance,
        settings.split_points,
        getattr(model, "example_input_array", None) is not None,
        settings.frontend == "trace",
    )
    if search is None:
        found = candidates(space, pipeline_size, batch, len(profile.layout.blocks))
    else:
        found = search.candidates(space, profile)
    if baseline not in found:
        found.append(baseline)
    transfer, collective = first.transfer(), first.collective()

    def trial_of(candidate: Candidate) -> TrialResult:
        make = functools.partial(_strategy, strategy, candidate.settings())
        size = search.replica_batch(candidate) if search is not None else None
        with _per_replica_batch(knob, size):
            found = run_trial(setup, make, model, fit_kwargs, steps, warmup, False)
        _check_replica_batch(found, size, knob)
        return found

    runs = {baseline: [first]}
    measured = {baseline: measured_of(runs[baseline])}
    peaks, actions, state = first.peaks(pipeline_size), first.action_medians(), first.first.state_factor
    trials = [Trial(baseline, measured[baseline].step, peaks, actions, state)]
    while True:
        calibration = calibrate(profile, rule, pipeline_size, trials, transfer, collective)
        model_says = {c: predict(c, profile, rule, pipeline_size, calibration) for c in found}
        predictions = prune.corrected(model_says, measured)
        if len(measured) >= max_trials:
            break
        chosen = prune.next_trial(predictions, measured, limit, margin)
        if chosen is None:
            break
        trial = trial_of(chosen)
        runs[chosen] = [trial]
        measured[chosen] = measured_of(runs[chosen])
        trials.append(Trial(chosen, measured[chosen].step, trial.peaks(chosen.pipeline_size or pipeline_size)))
    repeated = _repeat(runs, measured, limit, confirm, trial_of)
    choice = prune.choose(measured, limit)
    if choice is None:
        raise PipelineConfigError(
            f"No measured setting stayed within `memory_limit` ({format_bytes(limit or 0)} per process): the"
            f" smallest peak measured was {format_bytes(min(m.peak for m in measured.values()))}. Raise the limit, add"
            " activation checkpointing to the search space, or use more processes per pipeline."
        )
    spent = collectives.all_gather_object(time.process_time() - start_cpu, collectives.world_group(), device)
    wall = time.perf_counter() - start_wall
    # Until the first trial's first step: starting the processes (which `fit` would do anyway) and the first split.
    launch = first.first.wall[0] / 1e9 - start_wall if collectives.world_rank() == 0 else 0.0
    cost = {
        "wall_s": wall,
        "launch_s": launch,
        "cpu_s": float(sum(spent)),
        "trials": float(sum(len(r) for r in runs.values())),
        "measured": float(len(measured)),
        "steps": float(sum(len(r) for r in runs.values()) * (steps + warmup)),
        "profile_s": profile_s,
        "step_s": measured[choice].step,
        "in_steps": (wall - launch) / measured[choice].step,
        "candidates": float(len(found)),
        "repeated": float(repeated),
    }
    # Global rank 0's clock, on every rank.
    cost = collectives.broadcast_object(cost, 0, collectives.world_group(), device)
    shared = first.shared_cores() if device.type == "cpu" else []
    notes = ((shared_cores_note(shared),) if shared else ()) + (search.notes if search is not None else ())
    size = search.changed_batch(choice) if search is not None else None
    if search is not None and choice.pipeline_size == 1:
        replicas = search.world_size // choice.tensor_parallel
        notes += (
            f"No pipeline is fastest within the memory limit: one stage per process, {choice.data_parallel} over"
            f" {replicas} replicas (pipeline_size=1) is set.",
        )
    sure = prune.how_sure(measured, limit, choice)
    return choice, prune.rows(predictions, measured, choice, limit, margin), cost, notes, size, sure


@dataclass(frozen=True)
class _LayoutSearch:
    """The layouts of a search: the strategy's own, the global batch they share, and the per-replica batch each
    trains on."""

    own: ProcessLayout
    layouts: tuple[ProcessLayout, ...]
    world_size: int
    global_batch: int
    #: samples per replica in the first trial's first batch: the profile slices it, so no microbatch may be larger
    first_batch: int
    notes: tuple[str, ...]
    #: the search space, without the tensor-parallel sizes the model does not allow
    space: SearchSpace

    @classmethod
    def of(
        cls, space: SearchSpace, resolved: Any, batch: int, knob: Optional[BatchKnob], notes: list[str]
    ) -> _LayoutSearch:
        own = ProcessLayout(
            int(resolved.pipeline_size),
            resolved.data_parallel_size,
            resolved.tensor_parallel_size,
            resolved.data_parallel,
        )
        notes = list(notes)
        if knob is not None and knob.value != batch:
            notes.append(
                f"The `{BATCH_ATTRIBUTE}` of the {knob.section} ({knob.value}) is not the batch the DataLoader gave"
                f" ({batch} samples), so the tuner cannot keep the global batch under another data-parallel size."
            )
            knob = None
        world = int(resolved.world_size)
        found, why = layouts(space, world, own, batch * own.data_parallel_size if knob is not None else None)
        return cls(own, tuple(found), world, batch * own.data_parallel_size, batch, tuple(notes + why), space)

    def pipeline_batch(self, layout: ProcessLayout) -> int:
        return self.global_batch // layout.data_parallel_size

    def profiled(self, size: int) -> bool:
        """Whether microbatches of ``size`` samples can be sliced from the first batch."""
        return size <= self.first_batch and self.first_batch % size == 0

    def sizes(self, space: SearchSpace) -> set[int]:
        """Samples per microbatch of every layout's microbatch counts (those the first batch can give)."""
        out = set()
        for layout in self.layouts:
            batch = self.pipeline_batch(layout)
            out |= {batch // m for m in space.counts_to_profile(layout.pipeline_size, batch)}
        return {size for size in out if self.profiled(size)}

    def candidates(self, space: SearchSpace, profile: Profile) -> list[Candidate]:
        out = []
        for layout in self.layouts:
            batch, blocks = self.pipeline_batch(layout), len(profile.layout.blocks)
            found = candidates(space, layout.pipeline_size, batch, blocks, layout)
            out += [c for c in found if self.profiled(batch // c.microbatches)]
        return out

    def replica_batch(self, candidate: Candidate) -> Optional[int]:
        """The per-replica batch ``candidate`` trains on, when it differs from the strategy's own."""
        layout = ProcessLayout.of(candidate, self.world_size)
        if layout.data_parallel_size == self.own.data_parallel_size:
            return None
        return self.pipeline_batch(layout)

    def changed_batch(self, choice: Candidate) -> Optional[int]:
        return self.replica_batch(choice) if choice.pipeline_size else None


def _layout_search(
    model: Any, settings: Any, space: SearchSpace, resolved: Any, batch: int, knob: Optional[BatchKnob]
) -> _LayoutSearch:
    space, refused = planned_tensor_sizes(model, settings, space, int(resolved.tensor_parallel_size))
    return _LayoutSearch.of(space, resolved, batch, knob, refused)


def planned_tensor_sizes(model: Any, settings: Any, space: SearchSpace, own: int) -> tuple[SearchSpace, list[str]]:
    """``space`` without the tensor-parallel sizes above 1 the model does not allow: its kind has no plan for them
    (or refuses the size) and its LightningModule applies none in ``configure_model``; a note names them."""
    import lightning.pytorch as pl

    from lightning_pipe.models import kind_of
    from lightning_pipe.split.builder import network_layout

    sizes = space.tensor_parallel or ()
    if all(size == 1 for size in sizes) or type(model).configure_model is not pl.LightningModule.configure_model:
        return space, []
    network, _ = network_layout(model, settings)
    refused = []
    for size in sizes:
        if size == 1:
            continue
        try:
            plan = kind_of(network).tensor_parallel_plan(network, size)
        except (PipelineConfigError, PipelineModelError):
            plan = None
        if plan is None:
            refused.append(size)
    if not refused:
        return space, []
    kept = tuple(size for size in sizes if size not in refused) or (own,)
    note = (
        f"tensor_parallel={', '.join(map(str, refused))} left out: {type(network).__name__} has no tensor-parallel"
        f" plan of its own for that size and {type(model).__name__} applies none in `configure_model`"
        " (docs/tensor-parallel.md)."
    )
    return dataclasses.replace(space, tensor_parallel=kept), [note]


def _check_replica_batch(trial: TrialResult, size: Optional[int], knob: Optional[BatchKnob]) -> None:
    """A layout's trial must have trained on the per-replica batch it set: else its global batch was another."""
    seen = {m.samples for m in trial.everyone}
    if size is not None and knob is not None and seen != {size}:
        raise PipelineConfigError(
            f"The tuner set `{BATCH_ATTRIBUTE}={size}` on the {knob.section} for a layout with more or fewer"
            f" data-parallel replicas, but the DataLoader gave batches of {sorted(seen)} samples: it does not read"
            f" `{BATCH_ATTRIBUTE}` when it is built. Build the DataLoader from `self.{BATCH_ATTRIBUTE}` (or"
            f" `self.hparams.{BATCH_ATTRIBUTE}`), or leave `pipeline_sizes`, `tensor_parallel` and `data_parallel`"
            " out of the search space."
        )


@contextmanager
def _per_replica_batch(knob: Optional[BatchKnob], size: Optional[int]) -> Iterator[None]:
    """The per-replica batch set to ``size`` while a trial runs (nothing when ``None``)."""
    if knob is None or size is None:
        yield
        return
    knob.set(size)
    try:
        yield
    finally:
        knob.restore()


def _profile(
    model: Any,
    settings: Any,
    first: TrialResult,
    space: SearchSpace,
    pipeline_size: int,
    baseline: Candidate,
    device: torch.device,
    layout_sizes: set[int],
) -> Profile:
    """Rank 0 profiles the network on the first batch at every microbatch size in play (``layout_sizes``: those of
    other layouts too); every rank gets the result."""
    batch = first.batch_size()
    sizes = {batch // m for m in space.counts_to_profile(pipeline_size, batch)} | {batch // baseline.microbatches}
    sizes |= layout_sizes
    profile = None
    if collectives.world_rank() == 0:
        profile = profile_network(copy.deepcopy(model), settings, first.first.batch, sorted(sizes), device)
    return collectives.broadcast_object(profile, 0, collectives.world_group(), device)


def _strategy(strategy: Any, changes: dict[str, Any]) -> Any:
    """A new strategy of the user's strategy's class and settings, with ``changes``."""
    base = strategy.settings
    arguments = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.name != "world_size"}
    arguments.update(changes)
    if arguments.get("compile") is True and base.compile:
        arguments["compile"] = base.compile  # the user's torch.compile options
    return type(strategy)(**_constructor_values(arguments))


def _constructor_values(arguments: dict[str, Any]) -> dict[str, Any]:
    out = dict(arguments)
    for name in ("split_points", "balance"):
        if isinstance(out.get(name), tuple):
            out[name] = list(out[name])
    if out.get("compile") is None:
        out["compile"] = False
    return out


def _applied(choice: Candidate, settings: Any) -> dict[str, Any]:
    out = choice.settings()
    if choice.compile and settings.compile:
        out["compile"] = dict(settings.compile)
    return out


def _repeat(
    runs: dict[Candidate, list[TrialResult]],
    measured: dict[Candidate, prune.Measured],
    limit: Optional[float],
    confirm: int,
    trial_of: Any,
) -> int:
    """Rounds of the leader and the candidates within the measured noise of it, one trial each, until none is left
    or ``confirm`` trials ran; the order reversed every round, so that a slower stretch of the machine hits both ends
    alike. Returns the trials run."""
    repeated, rounds = 0, 0
    while found := prune.repeat_round(measured, limit, confirm - repeated):
        for again in found if rounds % 2 == 0 else reversed(found):
            runs[again].append(trial_of(again))
            measured[again] = measured_of(runs[again])
        repeated, rounds = repeated + len(found), rounds + 1
    return repeated


def _facts(
    trainer: Any,
    model: Any,
    datamodule: Any,
    space: SearchSpace,
    memory_limit: Any,
    knob: Optional[BatchKnob] = None,
) -> dict[str, Any]:
    """What a choice depends on and ``tune`` can see before any process starts. When the space searches the layout,
    the strategy's layout and the per-replica batch are not among them (the choice sets both), the global batch is."""
    settings = trainer.strategy.settings
    tuned = {"schedule", "microbatches", "microbatch_size", "stages_per_rank", "activation_checkpointing", "compile"}
    tuned |= {"world_size", "timeout"}
    if space.searches_layout:
        tuned |= {"pipeline_size", "data_parallel", "tensor_parallel"}
    untuned = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.name not in tuned}
    hparams = dict(getattr(model, "hparams", {}) or {})
    data = dict(getattr(datamodule, "hparams", {}) or {}) if datamodule is not None else None
    extra: dict[str, Any] = {}
    if space.searches_layout:
        for found in (hparams, data or {}):
            found.pop(BATCH_ATTRIBUTE, None)
        world = trainer.num_devices * trainer.num_nodes
        replicas = settings.resolve(world).data_parallel_size
        extra["global_batch"] = knob.value * replicas if knob is not None else None
    return {
        **extra,
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "parameters": sum(p.numel() for p in model.parameters()),
        "hparams": hparams,
        "data": data,
        "devices": trainer.num_devices,
        "num_nodes": trainer.num_nodes,
        "accelerator": type(trainer.accelerator).__name__,
        "precision": str(trainer.precision),
        "settings": untuned,
        "space": space.as_dict(),
        "memory_limit": memory_limit,
        "torch": torch.__version__,
    }


def _check_budget(steps: int, warmup: int, max_trials: int, confirm: int, margin: float, memory_limit: Any) -> None:
    checks = (("steps", steps, 1), ("warmup_steps", warmup, 1), ("max_trials", max_trials, 1), ("confirm", confirm, 0))
    for name, value, least in checks:
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise PipelineConfigError(f"`tune({name}={value!r})` must be an int >= {least}.")
    if not isinstance(margin, (int, float)) or margin < 0:
        raise PipelineConfigError(f"`tune(margin={margin!r})` must be a number >= 0 (a fraction, e.g. 0.1).")
    if memory_limit is not None and (not isinstance(memory_limit, (int, float)) or memory_limit <= 0):
        raise PipelineConfigError(f"`tune(memory_limit={memory_limit!r})` must be None or a number of bytes > 0.")


@contextmanager
def _kept_random_state() -> Iterator[None]:
    """Trials draw random numbers (dropout, shuffling, initialisation of meta models); the run must not notice."""
    import numpy as np

    states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _summary(
    choice: Candidate, table: str, cost: dict[str, float], config: Path, notes: tuple[str, ...], sure: Sureness
) -> str:
    return "".join(f"Note: {note}\n" for note in notes) + (
        f"Pipeline tuning: {int(cost['trials'])} trials of {int(cost.get('measured', cost['trials']))} of"
        f" {int(cost['candidates'])} candidates,"
        f" {cost['wall_s']:.1f} s ({cost['launch_s']:.1f} s to start the processes and the first trial; after it"
        f" {cost['in_steps']:.0f} steps of the choice; profiling {cost['profile_s']:.1f} s; {cost['cpu_s']:.1f} CPU s"
        f" in all processes). Chosen: {choice.label},"
        f" {cost['step_s'] * 1e3:.1f} ms per step; {sure.describe()}.\n{table}\nLightningCLI: --config {config}"
    )


def _announce(text: str) -> None:
    if not collectives.is_initialized() or collectives.world_rank() == 0:
        log.info(text)
