"""Where the model is split: from a LightningModule to the stage bodies this rank owns.

The cut happens in place (other stages' units are removed from the network), so it is recorded on the LightningModule
as a :class:`Split`: a later Trainer entry (``fit`` then ``test``, or a second Trainer) reuses it when the stages it
needs are the same (:meth:`PipelineSettings.split_key`: another schedule of the same placement, other activation
checkpointing or data parallelism), and is refused with the difference named when they are not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_pipe.errors import PipelineConfigError, PipelineModelError, PipelineUsageError
from lightning_pipe.measure.memory import PeakMemory
from lightning_pipe.microbatch import batch_size, resolve_microbatches, split_batch
from lightning_pipe.models import kind_of, use_plan
from lightning_pipe.models.base import Placeholder, StageCall
from lightning_pipe.models.huggingface.directory import is_hf_directory, new_head_notice
from lightning_pipe.models.units import ONE_UNIT, Layout, find_block_stack, find_layout
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.split.balance import CostModel, measure_update_time, resolve_balance, split_table
from lightning_pipe.split.calls import call_traced
from lightning_pipe.split.dataflow import DataflowCall, dataflow_frontend, dataflow_layout
from lightning_pipe.split.deferred_init import InitRecording
from lightning_pipe.split.frontend import choose_frontend
from lightning_pipe.split.initialization import initialize, loaded_names, warn_whole_model
from lightning_pipe.split.partition import (
    counts_from_split_points,
    keep_together,
    one_unit_counts,
    stage_to_rank,
    stage_units,
)
from lightning_pipe.split.surgery import (
    call_passing_on,
    check_ownership,
    has_meta_tensors,
    merge,
    prune,
    retarget_meta_constants,
    stage_view,
    trace_stages,
)
from lightning_pipe.split.tied import Tie, plan_ties, retie, tied_groups
from lightning_pipe.structures import is_dtensor

SPLIT_ATTR = "_lightning_pipe_split"


@dataclass
class Split:
    """A LightningModule cut down to one rank's stages."""

    #: :meth:`PipelineSettings.split_key` of the settings the cut was made with
    key: tuple
    #: the same settings, described by name for messages
    described: str
    num_stages: int
    #: pipeline rank of every stage
    stage_ranks: list[int]
    #: this rank's stage bodies by stage index (views sharing the network's parameters, or traced graphs)
    bodies: dict[int, nn.Module]
    #: units of the network that each local stage does not hold
    absent: dict[int, tuple[str, ...]]
    stage_call: StageCall
    #: the module whose forward the user's step calls (replaced by the interceptor while the strategy runs)
    network: nn.Module
    #: attribute of the LightningModule holding the network before the cut ("" for the LightningModule itself)
    network_attr: str
    #: the network's units in execution order, and each stage's
    layout: Layout
    units_per_stage: list[tuple[str, ...]]
    #: parameters shared by units of several stages (names relative to the network)
    ties: list[Tie] = field(default_factory=list)
    #: the names of every parameter the network reached under several names before the cut (relative to the network;
    #: a tie inside one stage too): tensor parallelism replaces parameters and must tie them again
    shared: list[tuple[str, ...]] = field(default_factory=list)
    #: traced stages may bake the example microbatch's size into reshapes (evaluation pads to it)
    static_microbatch_size: int | None = None
    #: bytes allocated at most while this rank's stages were allocated and initialised (meta construction), or None
    construction_peak: int | None = None
    #: the runnable stage modules, made once by the step layer (per-stage FSDP stays on them for later entries)
    stages: dict[int, Any] | None = None
    #: the global ranks of the data-parallel group the stages were sharded over with FSDP (``None``: not sharded).
    #: FSDP cannot be taken off a module in place, so a later entry must shard alike.
    sharded_over: tuple[int, ...] | None = None
    #: what tensor parallelism did to the stages (a ``parallel.tensor_parallel.TensorParallelDone``), kept for later
    #: entries: a model's own plan is applied once
    tensor_parallel: Any = None
    #: the blocks per stage global rank 0 decided (a replacement rank of a recovery in place cuts with them)
    counts: tuple[int, ...] = ()
    #: the shape of every entry of the uncut network's state dict (``None``: not a tensor), by name relative to the
    #: network: a whole model's state dict is checked against it on every rank
    state_shapes: dict[str, tuple[int, ...] | None] = field(default_factory=dict)

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        # A pickled or deep-copied LightningModule (`torch.save(model)`, EMA/SWA callbacks) keeps only which stages
        # it holds: the stages, process groups and stage calls belong to this rank's run.
        return CopiedSplit, (self.described, self.units_per_stage, self.stage_ranks)

    @property
    def block_names(self) -> tuple[str, ...]:
        """Every block of the network's block stack, relative to the network."""
        return self.layout.blocks

    @property
    def prefix(self) -> str:
        """The network's attribute as a name prefix (``"model."``; ``""`` for the LightningModule itself)."""
        return f"{self.network_attr}." if self.network_attr else ""


@dataclass(frozen=True)
class CopiedSplit:
    """What a pickled or deep-copied split LightningModule records: it holds one rank's units, and cannot be split
    again."""

    described: str
    units_per_stage: list[tuple[str, ...]]
    stage_ranks: list[int]

    def refuse(self) -> None:
        raise PipelineUsageError(
            "This LightningModule is a copy (pickled, `copy.deepcopy` or `torch.save`) of one pipeline rank's stages"
            f" ({self.described}): its network holds only that rank's units, so it"
            " cannot be split again. Give the Trainer the original LightningModule, or a new instance with the"
            " checkpoint's weights loaded (`python -m lightning_pipe.checkpoint consolidate` makes one file)."
        )


def resolve_module(lightning_module: nn.Module, module_name: str) -> tuple[str, nn.Module]:
    """The attribute holding the network and the network; ``""`` means the LightningModule itself.

    ``"auto"``: the only direct child with parameters, else the LightningModule itself.
    """
    if module_name != "auto":
        if not module_name:
            return "", lightning_module
        found = getattr(lightning_module, module_name, None)
        if not isinstance(found, nn.Module):
            raise PipelineModelError(
                f"`module={module_name!r}`: {type(lightning_module).__name__} has no submodule of that name. Pass the"
                " attribute that holds the network (e.g. 'model'), '' for the LightningModule itself, or 'auto'."
            )
        return module_name, found
    with_params = [(n, c) for n, c in lightning_module.named_children() if any(True for _ in c.parameters())]
    if not with_params:
        raise PipelineModelError(
            f"{type(lightning_module).__name__} has no submodule with parameters to pipeline. Create the network in"
            " `__init__` or `configure_model`."
        )
    if len(with_params) == 1:
        return with_params[0]
    return "", lightning_module


def has_network(lightning_module: nn.Module, module_name: str) -> bool:
    """Whether the network to pipeline exists yet (it may be built later, in ``configure_model``)."""
    try:
        resolve_module(lightning_module, module_name)
    except PipelineModelError:
        return False
    return True


def check_whole_before_split(network: nn.Module) -> None:
    """Refuse a network whose parameters are already split over processes (DTensors) before the cut."""
    split = [name for name, p in network.named_parameters() if is_dtensor(p)]
    if split:
        raise PipelineModelError(
            f"Parameters of {type(network).__name__} ({', '.join(split[:3])}{', ...' if len(split) > 3 else ''}) are"
            " already DTensors (tensor parallelism or FSDP applied) before the strategy cut the network into stages."
            " The cut comes first: build the network in `__init__` (under `torch.device('meta')` for a large one) and"
            " apply `parallelize_module` in `configure_model` with `self.device_mesh['tp']`; with"
            " `tensor_parallel > 1` the strategy cuts the network before `configure_model`, which then sees only this"
            " rank's units. Apply no plan when `self.device_mesh['tp'].size() == 1`, and leave FSDP to"
            " `data_parallel='fsdp'`."
        )


def _example_microbatch(lightning_module: Any, settings: PipelineSettings) -> tuple[tuple[Any, ...], dict[str, Any]]:
    example = getattr(lightning_module, "example_input_array", None)
    if example is None:
        raise PipelineModelError(
            "`frontend='trace'` traces the network with an example input: set `self.example_input_array` in the"
            " LightningModule to one full batch of network inputs (a tensor, a tuple of tensors or a dict)."
        )
    size = batch_size(example)
    n = resolve_microbatches(settings.microbatches, settings.microbatch_size, size, settings.num_stages, "microbatches")
    first = split_batch(example, n, size=size)[0]
    if isinstance(first, dict):
        return (), first
    if isinstance(first, (tuple, list)):
        return tuple(first), {}
    return (first,), {}


@dataclass(frozen=True)
class _Frontend:
    """How a frontend treats a network: its units, what stands in for absent ones, how a stage is called."""

    layout: Layout
    placeholder: Placeholder | None
    stage_call: StageCall


def _layout(network: nn.Module, settings: PipelineSettings) -> Layout:
    """The units of ``network`` as its frontend sees them (no stand-ins, no stage call: nothing is built)."""
    if settings.frontend == "dataflow":
        return dataflow_layout(network, settings.blocks)
    if settings.frontend == "trace":
        layout = find_layout(network, settings.blocks)  # the tracer cuts at blocks, whatever the model's kind
        if layout == ONE_UNIT:
            find_block_stack(network, "auto")  # raises: a network of one module has no block to cut at
        return layout
    return kind_of(network).layout(network, settings.blocks)


def _with_frontend(network: nn.Module, settings: PipelineSettings, announce: Callable[[str], None]) -> PipelineSettings:
    """``settings`` with ``frontend="auto"`` resolved for ``network`` (:mod:`lightning_pipe.split.frontend`), said
    once on rank 0."""
    if settings.frontend != "auto":
        return settings
    several = not isinstance(settings.blocks, str)
    chosen, why = choose_frontend(network, settings.frontend, settings.tensor_parallel_size, several)
    announce(f"lightning-pipe: `frontend='auto'` chose {chosen!r}: {why}.")
    return settings.with_frontend(chosen)


def _frontend(network: nn.Module, settings: PipelineSettings, device: torch.device) -> _Frontend:
    layout = _layout(network, settings)
    if settings.frontend == "trace":
        return _Frontend(layout, None, call_traced)
    if settings.frontend == "dataflow":
        # Every stage runs the whole forward; what stands in for absent units and the routes need the whole network.
        placeholder, stage_call = dataflow_frontend(network, layout, device)
        return _Frontend(layout, placeholder, stage_call)
    kind = kind_of(network)
    return _Frontend(layout, kind.placeholder(network), kind.stage_call)


def network_layout(lightning_module: nn.Module, settings: PipelineSettings) -> tuple[nn.Module, Layout]:
    """The network the strategy would split and its units, without splitting it."""
    _, network = resolve_module(lightning_module, settings.module)
    if settings.model_plan is not None:
        use_plan(network, settings.model_plan)
    return network, _layout(network, _with_frontend(network, settings, lambda text: None))


def _counts(
    lightning_module: Any,
    network: nn.Module,
    layout: Layout,
    settings: PipelineSettings,
    device: torch.device,
    agree: Callable[[Any], Any],
    announce: Callable[[str], None],
) -> list[int]:
    """Blocks per stage: ``split_points``, an explicit ``balance`` list, or ``"auto"``/``"params"``/``"blocks"``.

    ``"auto"`` profiles the network on one microbatch of ``example_input_array`` when the LightningModule has one,
    and balances parameters otherwise. Measured times differ between processes, so rank 0's result is used by all
    (``agree``). Traced stages are cut at block boundaries, so every stage needs a block of its own: the even split.
    """
    num_stages = settings.num_stages
    if settings.split_points is not None:
        return counts_from_split_points(layout.blocks, settings.split_points, num_stages)
    balance = "blocks" if settings.frontend == "trace" and isinstance(settings.balance, str) else settings.balance
    example = None
    if balance == "auto" and getattr(lightning_module, "example_input_array", None) is not None:
        example = _example_microbatch(lightning_module, settings)
    mode = "params" if balance == "auto" and example is None else balance
    model = None
    if mode == "auto":
        m = int(settings.microbatches) if settings.microbatches != "auto" else num_stages
        model = CostModel(m, min(m, num_stages), measure_update_time(device))
    counts, profiles = resolve_balance(mode, network, layout, num_stages, example=example, device=device, model=model)
    counts = list(agree(counts))
    if isinstance(balance, str) and layout.together:
        counts = keep_together(counts, layout.together)
    announce(split_table(layout, counts, profiles, model if profiles else None, network))
    return counts


def split_module(
    lightning_module: Any,
    settings: PipelineSettings,
    *,
    pipeline_rank: int,
    device: torch.device,
    agree: Callable[[Any], Any] = lambda value: value,
    announce: Callable[[str], None] = lambda text: None,
    recording: InitRecording | None = None,
) -> Split:
    """Cut the LightningModule's network down to this rank's stages (in place), or return the cut made before.

    ``settings`` are resolved (:meth:`PipelineSettings.resolve`). ``agree(value)`` returns global rank 0's ``value``
    on every rank; ``announce(text)`` prints on rank 0. ``recording``: what ``configure_model`` did to the meta
    tensors, replayed on this rank's stages (:mod:`lightning_pipe.split.deferred_init`).
    """
    key = (*settings.split_key(), pipeline_rank)
    existing = lightning_module.__dict__.get(SPLIT_ATTR)
    if isinstance(existing, CopiedSplit):
        existing.refuse()
    if existing is not None:
        check_same_split(existing, key, settings.describe_split())
        return existing
    attr, network = resolve_module(lightning_module, settings.module)
    check_whole_before_split(network)
    state_shapes = _state_shapes(network)
    if settings.model_plan is not None:
        use_plan(network, settings.model_plan)  # the user's plan, where the transformers kind reads a family's
    settings = _with_frontend(network, settings, announce)
    shared = [tuple(group) for group in tied_groups(network)]
    prefix = f"{attr}." if attr else ""
    num_stages = settings.num_stages
    plan = _frontend(network, settings, device)
    layout = plan.layout
    if layout == ONE_UNIT and num_stages > 1:
        counts = one_unit_counts(network, attr, settings)
        plan = _Frontend(layout, plan.placeholder, call_passing_on(plan.stage_call))
    elif len(layout.blocks) < num_stages:
        raise PipelineConfigError(
            f"The pipeline needs {num_stages} stages ({settings.pipeline_size} ranks x {settings.stages_per_rank}"
            f" stages per rank) but the network has only {len(layout.blocks)} blocks; every stage needs at least one."
            " Use fewer processes per pipeline (`pipeline_size`), fewer `stages_per_rank`, or a deeper model."
        )
    else:
        counts = _counts(lightning_module, network, layout, settings, device, agree, announce)
    units_per_stage = stage_units(layout, counts)
    ranks = stage_to_rank(num_stages, int(settings.pipeline_size), settings.placement)
    local = [s for s in range(num_stages) if ranks[s] == pipeline_rank]
    seed = torch.initial_seed()
    init = {"init_values": settings.init_values, "loaded": _loaded(network, prefix, settings)}
    absent = {s: tuple(u for u in layout.units if u not in units_per_stage[s]) for s in local}
    ties = plan_ties(network, layout.units, units_per_stage)
    common = {
        "key": key,
        "described": f"{settings.describe_split()}, pipeline_rank={pipeline_rank}",
        "num_stages": num_stages,
        "stage_ranks": ranks,
        "absent": absent,
        "stage_call": plan.stage_call,
        "network_attr": attr,
        "layout": layout,
        "units_per_stage": units_per_stage,
        "ties": ties,
        "shared": shared,
        "counts": tuple(counts),
        "state_shapes": state_shapes,
    }
    if settings.frontend == "trace":
        split = _trace(lightning_module, network, counts, local, settings, device, common, recording, init)
    else:
        check_ownership(network, layout.units)
        full_bytes = _tensor_bytes(network)
        meta = has_meta_tensors(network)
        construction_peak = None
        prune(network, [u for s in local for u in units_per_stage[s]], layout.units, placeholder=plan.placeholder)
        if meta:
            # Parameters shared inside this rank's stages, to be shared again afterwards; those shared with another
            # rank's stages are copies kept equal (`ties`). A tie between two stages of this rank (the first and last
            # stage of a V) is one Parameter, as built in `__init__`.
            across = {name for tie in ties if len({ranks[s] for s in tie.stages}) > 1 for name in tie.names}
            shared = [group for group in tied_groups(network) if not across.intersection(group)]
            with PeakMemory(device) as peak:
                initialize(
                    network,
                    device,
                    seed,
                    units=layout.units,
                    owner=lightning_module,
                    recording=recording,
                    prefix=prefix,
                    **init,
                )
            retie(network, shared)
            construction_peak = peak.bytes
        elif num_stages > 1:
            warn_whole_model(full_bytes, _tensor_bytes(network))
        # Views share the kept units (and their parameters) with `network`; made before the interceptor is installed
        # so that they keep the network's own forward.
        bodies = {s: stage_view(network, units_per_stage[s], layout.units, placeholder=plan.placeholder) for s in local}
        if isinstance(plan.stage_call, DataflowCall):
            plan.stage_call.bind(units_per_stage, bodies, network)
        split = Split(bodies=bodies, network=network, construction_peak=construction_peak, **common)
    lightning_module.__dict__[SPLIT_ATTR] = split
    return split


def _state_shapes(network: nn.Module) -> dict[str, tuple[int, ...] | None]:
    # Before the cut (meta tensors too: nothing is read), for a whole model's state dict loaded later.
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in network.state_dict().items()}


def _loaded(network: nn.Module, prefix: str, settings: PipelineSettings) -> frozenset[str]:
    """What ``init_weights`` sets when it is a Hugging Face directory: one device's ``from_pretrained`` draws nothing
    for those tensors. (A one-device script loading a ``.ckpt`` or state dict builds its model first, drawing.)"""
    if settings.init_weights is None or not is_hf_directory(settings.init_weights) or not has_meta_tensors(network):
        return frozenset()
    notice = new_head_notice(settings.init_weights, network) if settings.init_values == "one_device" else None
    if notice is not None:
        from lightning.fabric.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(notice)
    return loaded_names(network, prefix)


def _tensor_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _trace(
    lightning_module: Any,
    network: nn.Module,
    counts: list[int],
    local: list[int],
    settings: PipelineSettings,
    device: torch.device,
    common: dict[str, Any],
    recording: InitRecording | None,
    init: dict[str, Any],
) -> Split:
    attr, layout = common["network_attr"], common["layout"]
    if not attr:
        raise PipelineModelError(
            "`frontend='trace'` needs the network in an attribute of the LightningModule (e.g. `self.model`),"
            " not layers defined on the LightningModule itself. Set `module=` to that attribute."
        )
    args, kwargs = _example_microbatch(lightning_module, settings)
    static = batch_size((args, kwargs))
    seed = torch.initial_seed()
    if has_meta_tensors(network):
        args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    state_keys = set(common["state_shapes"])
    starts = [sum(counts[:s]) for s in range(1, len(counts))]
    traced = trace_stages(network, args, kwargs, [layout.blocks[i] for i in starts])
    bodies = {s: traced[s] for s in local}
    for body in bodies.values():
        retarget_meta_constants(body, device)
    _retie_traced(bodies, common["ties"])
    holder = merge(list(bodies.values()), state_keys)
    setattr(lightning_module, attr, holder)
    if has_meta_tensors(holder):
        prefix = f"{attr}."
        initialize(holder, device, seed, units=(), owner=lightning_module, recording=recording, prefix=prefix, **init)
    return Split(bodies=bodies, network=holder, static_microbatch_size=static, **common)


def is_split(lightning_module: Any) -> bool:
    """Whether :func:`split_module` already cut this LightningModule down to a rank's stages."""
    return SPLIT_ATTR in lightning_module.__dict__


def existing_split(lightning_module: Any) -> Split | None:
    """The split made by an earlier Trainer entry, if any."""
    existing = lightning_module.__dict__.get(SPLIT_ATTR)
    if isinstance(existing, CopiedSplit):
        existing.refuse()
    return existing


def _retie_traced(bodies: dict[int, nn.Module], ties: list[Tie]) -> None:
    """torch's tracer gives every stage its own copy of a shared parameter: a rank holding several of the stages
    sharing it gets one Parameter again (the copies on other ranks are kept equal by the strategy)."""
    for tie in ties:
        shared: nn.Parameter | None = None
        for body in bodies.values():
            for name in tie.names:
                parent, _, leaf = name.rpartition(".")
                try:
                    owner = body.get_submodule(parent) if parent else body
                except AttributeError:
                    continue
                param = getattr(owner, leaf, None)
                if not isinstance(param, nn.Parameter):
                    continue
                if shared is None:
                    shared = param
                elif param is not shared:
                    setattr(owner, leaf, shared)


def check_same_split(existing: Split, key: tuple, described: str) -> None:
    """Refuse a later Trainer entry whose stages would differ from the ones this LightningModule was cut into."""
    if existing.key != key:
        raise PipelineConfigError(
            "This LightningModule was already split into other pipeline stages by an earlier Trainer"
            f" ({existing.described}); these settings need other stages ({described}). The split happens in place"
            " and cannot be redone. Another schedule works when it places stages alike (1F1B <-> GPipe,"
            " Interleaved1F1B <-> LoopedBFS <-> InterleavedZeroBubble with the same stages_per_rank, ZBVZeroBubble"
            " <-> DualPipeV), as do other activation-checkpointing and data-parallel settings; for another layout use"
            " a new LightningModule instance (loading a checkpoint into it)."
        )
