"""The layout the tuner may choose: how the processes split into pipeline x data x tensor parallelism.

A :class:`ProcessLayout` is a pipeline size, a tensor-parallel size, the data-parallel size they leave of the world
(``world / (pipeline * tensor)``) and how stages are replicated over the data-parallel pipelines (``"ddp"``: whole
copies, ``"fsdp"``: sharded). :func:`layouts` lists those of a :class:`~lightning_pipe.tune.space.SearchSpace`;
pipeline size 1 (no pipeline: one stage per process, plain data parallelism or FSDP through the same strategy) is
one of them.

**The global batch stays the user's.** Lightning's DataLoader batch is per data-parallel replica, so a layout with
another data-parallel size would train on another global batch. A layout whose data-parallel size differs from the
strategy's own therefore also sets the per-replica batch to ``global batch / data-parallel size`` (the
:class:`BatchKnob`: the ``batch_size`` attribute or hyperparameter of the LightningModule or the DataModule, where
Lightning's batch-size finder looks for it). Without such an attribute, or when the global batch does not divide,
those layouts are left out and a note says why.

The cost of the layout's communication (:func:`ring_seconds`, :func:`data_parallel_seconds`,
:func:`tensor_parallel_seconds`) and its memory per process (:func:`state_bytes`) are modelled from an all-gather and
a reduce-scatter measured once over all processes; the assumptions are in each function's docstring.

Pure: no process group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lightning_pipe.tune.space import Candidate, SearchSpace

#: the attribute Lightning's batch-size finder scales
BATCH_ATTRIBUTE = "batch_size"


@dataclass(frozen=True, order=True)
class ProcessLayout:
    """A split of the processes: ``pipeline_size x data_parallel_size x tensor_parallel`` of them."""

    pipeline_size: int
    data_parallel_size: int
    tensor_parallel: int = 1
    data_parallel: str = "ddp"

    def carried_by(self, candidate: Candidate) -> Candidate:
        """``candidate`` with this layout."""
        return dataclasses.replace(
            candidate,
            pipeline_size=self.pipeline_size,
            data_parallel=self.data_parallel,
            tensor_parallel=self.tensor_parallel,
        )

    @classmethod
    def of(cls, candidate: Candidate, world_size: int) -> ProcessLayout:
        """The layout a candidate carries (which must carry one)."""
        replicas = world_size // (candidate.pipeline_size * candidate.tensor_parallel)
        return cls(candidate.pipeline_size, replicas, candidate.tensor_parallel, candidate.data_parallel)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(
    space: SearchSpace, world_size: int, own: ProcessLayout, global_batch: int | None
) -> tuple[list[ProcessLayout], list[str]]:
    """The layouts of ``space`` for ``world_size`` processes (``own``: the strategy's; ``global_batch``: samples per
    step over all replicas, ``None`` when the per-replica batch cannot be set), the strategy's own first; and a note
    for each kind of layout left out."""
    notes: list[str] = []
    tensor_sizes = space.tensor_parallel or (own.tensor_parallel,)
    modes = space.data_parallel or (own.data_parallel,)
    out: list[ProcessLayout] = []
    skipped_batch: list[str] = []
    for tp in tensor_sizes:
        if world_size % tp:
            notes.append(f"tensor_parallel={tp} does not divide the {world_size} processes: left out.")
            continue
        per_tp = world_size // tp
        if space.pipeline_sizes is None:
            sizes = [own.pipeline_size]
        elif space.pipeline_sizes == "auto":
            sizes = divisors(per_tp)
        else:
            sizes = list(space.pipeline_sizes)
        for pp in sizes:
            if per_tp % pp:
                notes.append(f"pipeline_size={pp} x tensor_parallel={tp} does not divide the {world_size} processes.")
                continue
            replicas = per_tp // pp
            if replicas != own.data_parallel_size and (global_batch is None or global_batch % replicas):
                skipped_batch.append(f"pp={pp} tp={tp} ({replicas} replicas)")
                continue
            # One replica: nothing to shard over, "ddp" and "fsdp" are the same layout.
            for mode in modes if replicas > 1 else ("ddp",):
                found = ProcessLayout(pp, replicas, tp, mode)
                if found not in out:
                    out.append(found)
    if skipped_batch:
        why = (
            f"the global batch ({global_batch} samples) does not divide among their replicas"
            if global_batch is not None
            else f"the per-replica batch cannot be set: no `{BATCH_ATTRIBUTE}` attribute or hyperparameter on the"
            " LightningModule or the DataModule, or the training DataLoader was passed built (add one, as Lightning's"
            " batch-size finder expects, and build the DataLoader from it in `train_dataloader`)"
        )
        notes.append(
            "Layouts with another data-parallel size keep the global batch by setting the per-replica batch, but"
            f" {why}: left out {', '.join(skipped_batch)}."
        )
    out.sort(key=lambda layout: layout != own)
    return out, notes


# ------------------------------------------------------------------------------------------------- the batch size
@dataclass
class BatchKnob:
    """Where the per-replica batch size lives: ``owner.batch_size`` or ``owner.hparams["batch_size"]``."""

    owner: Any
    #: ``"model"`` or ``"data"`` (the LightningCLI section)
    section: str
    in_hparams: bool
    value: int

    def set(self, value: int) -> None:
        if self.in_hparams:
            self.owner.hparams[BATCH_ATTRIBUTE] = value
        else:
            setattr(self.owner, BATCH_ATTRIBUTE, value)

    def restore(self) -> None:
        self.set(self.value)


def find_batch_knob(model: Any, datamodule: Any) -> BatchKnob | None:
    """The per-replica batch size, where Lightning's batch-size finder looks: the LightningModule's attribute, its
    hyperparameters, then the DataModule's attribute and hyperparameters."""
    for owner, section in ((model, "model"), (datamodule, "data")):
        if owner is None:
            continue
        value = owner.__dict__.get(BATCH_ATTRIBUTE, getattr(type(owner), BATCH_ATTRIBUTE, None))
        if _is_size(value):
            return BatchKnob(owner, section, False, int(value))
        hparams = getattr(owner, "hparams", None)
        if hparams is not None and _is_size(hparams.get(BATCH_ATTRIBUTE)):
            return BatchKnob(owner, section, True, int(hparams[BATCH_ATTRIBUTE]))
    return None


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# ---------------------------------------------------------------------------------------------- the communication
def ring_seconds(collective: tuple[float, float], total_bytes: float, ranks: int) -> float:
    """An all-gather or reduce-scatter of ``total_bytes`` (the whole, gathered size) over ``ranks`` processes: a
    ring's ``ranks - 1`` steps of ``latency + seconds_per_byte * total_bytes / ranks`` each. ``collective``: the
    ``(latency, seconds_per_byte)`` of a step, measured over all processes. Assumes every group's links are as fast
    as those the measurement crossed."""
    if ranks <= 1:
        return 0.0
    latency, per_byte = collective
    return (ranks - 1) * (latency + per_byte * total_bytes / ranks)


def data_parallel_seconds(collective: tuple[float, float], param_bytes: float, replicas: int) -> float:
    """Per step, the gradient synchronisation of a rank holding ``param_bytes`` of parameters over ``replicas``:
    ``"ddp"`` all-reduces the gradients (a reduce-scatter and an all-gather), ``"fsdp"`` all-gathers the parameters
    once per step (no unit reshards after its forward) and reduce-scatters the gradients: the same two rings. Not
    overlapped with compute (the strategy synchronises after the schedule)."""
    return 2 * ring_seconds(collective, param_bytes, replicas)


def tensor_parallel_seconds(collective: tuple[float, float], output_bytes: float, ranks: int) -> float:
    """Per block and microbatch, in forward or in backward: two all-reduces (a reduce-scatter and an all-gather each)
    of the block's output, as Megatron-style attention and MLP shards need."""
    return 4 * ring_seconds(collective, output_bytes, ranks)


def state_bytes(param_bytes: float, state_factor: float, layout: ProcessLayout | None) -> float:
    """Parameters, gradients and optimizer state of a rank whose stages hold ``param_bytes`` of parameters (before
    tensor parallelism). ``state_factor``: gradient and optimizer-state bytes per parameter byte. ``"ddp"`` (or no
    layout): a whole copy. ``"fsdp"``: the shard of parameters, gradients and state, plus the gathered parameters
    and their whole gradients while the step runs (no unit reshards after its forward)."""
    if layout is None:
        return param_bytes * (1.0 + state_factor)
    local = param_bytes / layout.tensor_parallel
    if layout.data_parallel != "fsdp" or layout.data_parallel_size == 1:
        return local * (1.0 + state_factor)
    return local * (2.0 + (1.0 + state_factor) / layout.data_parallel_size)
