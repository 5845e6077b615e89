"""Where the model is split: from a LightningModule to the stage bodies this rank owns.

The cut happens in place (other stages' units are removed from the network), so it is recorded on the LightningModule
as a :class:`Split`: a second Trainer entry (``fit`` then ``test``, or a second Trainer) reuses it instead of cutting
again. The strategy turns a split into runnable stages (:func:`stage_modules`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_pipe.balance import CostModel, measure_update_time, resolve_balance, split_table
from lightning_pipe.config import V_SHAPED, resolve_microbatches
from lightning_pipe.errors import PipelineConfigError, PipelineModelError
from lightning_pipe.hf import hf_layout, hf_placeholder, hf_stage_call, is_hf_model
from lightning_pipe.initialization import initialize, warn_whole_model
from lightning_pipe.memory import PeakMemory
from lightning_pipe.microbatch import batch_size, split_batch
from lightning_pipe.partition import (
    Layout,
    counts_from_split_points,
    find_layout,
    stage_to_rank,
    stage_units,
)
from lightning_pipe.side_inputs import CallBook, StageCall, StageModule, call_with_activation
from lightning_pipe.stages import (
    Placeholder,
    check_ownership,
    has_meta_tensors,
    merge,
    prune,
    retarget_meta_constants,
    stage_view,
    trace_stages,
)
from lightning_pipe.tied import Tie, plan_ties

SPLIT_ATTR = "_lightning_pipe_split"


@dataclass
class Split:
    """A LightningModule cut down to one rank's stages."""

    #: the settings the cut was made with (a later entry must use the same)
    settings: tuple
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
    #: traced stages may bake the example microbatch's size into reshapes (evaluation pads to it)
    static_microbatch_size: int | None = None
    #: the network's units in execution order, and each stage's
    layout: Layout | None = None
    units_per_stage: list[tuple[str, ...]] | None = None
    #: parameters shared by units of several stages (names relative to the network)
    ties: list[Tie] = field(default_factory=list)
    #: bytes allocated at most while this rank's stages were allocated and initialised (meta construction), or None
    construction_peak: int | None = None
    #: every block of the network's block stack (``Layout.blocks``), relative to the network
    block_names: tuple[str, ...] = ()
    #: the runnable stages, made once: per-stage wrappers (FSDP) stay on them for later Trainer entries
    stages: dict[int, StageModule] | None = None


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


def _example_microbatch(
    lightning_module: Any, microbatches: Any, microbatch_size: int | None, num_stages: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    example = getattr(lightning_module, "example_input_array", None)
    if example is None:
        raise PipelineModelError(
            "`frontend='trace'` traces the network with an example input: set `self.example_input_array` in the"
            " LightningModule to one full batch of network inputs (a tensor, a tuple of tensors or a dict)."
        )
    n = resolve_microbatches(microbatches, microbatch_size, batch_size(example), num_stages, "microbatches")
    first = split_batch(example, n)[0]
    if isinstance(first, dict):
        return (), first
    if isinstance(first, (tuple, list)):
        return tuple(first), {}
    return (first,), {}


def call_traced(
    body: nn.Module, args: tuple, kwargs: dict, received: tuple | None, is_first: bool, is_last: bool
) -> Any:
    """The stage call of traced stages: the first takes the network's call, later ones what the stage before sent
    (values a later stage needs from the network's input are threaded through the stages in between)."""
    return body(*args, **kwargs) if received is None else body(*received)


@dataclass(frozen=True)
class _Frontend:
    """How the modules frontend treats a network: its units, what stands in for absent ones, how a stage is called."""

    layout: Layout
    placeholder: Placeholder | None
    stage_call: StageCall


def _frontend(network: nn.Module, blocks: str) -> _Frontend:
    if is_hf_model(network):
        # Hugging Face models carry their own pipeline plan and need their own stage call.
        return _Frontend(hf_layout(network), hf_placeholder(network), hf_stage_call)
    return _Frontend(find_layout(network, blocks), None, call_with_activation)


def _counts(
    lightning_module: Any,
    network: nn.Module,
    layout: Layout,
    num_stages: int,
    split_points: Sequence[str] | None,
    balance: str | Sequence[int],
    microbatches: Any,
    microbatch_size: int | None,
    device: torch.device,
    agree: Callable[[Any], Any],
    announce: Callable[[str], None],
) -> list[int]:
    """Blocks per stage: ``split_points``, an explicit ``balance`` list, or ``"auto"``/``"params"``/``"blocks"``.

    ``"auto"`` profiles the network on one microbatch of ``example_input_array`` when the LightningModule has one,
    and balances parameters otherwise. Measured times differ between processes, so rank 0's result is used by all
    (``agree``).
    """
    if split_points is not None:
        return counts_from_split_points(layout.blocks, split_points, num_stages)
    example = None
    if balance == "auto" and getattr(lightning_module, "example_input_array", None) is not None:
        example = _example_microbatch(lightning_module, microbatches, microbatch_size, num_stages)
    mode = "params" if balance == "auto" and example is None else balance
    model = None
    if mode == "auto":
        m = int(microbatches) if isinstance(microbatches, int) else num_stages
        model = CostModel(m, min(m, num_stages), measure_update_time(device))
    counts, profiles = resolve_balance(mode, network, layout, num_stages, example=example, device=device, model=model)
    counts = list(agree(counts))
    announce(split_table(layout, counts, profiles, model if profiles else None, network))
    return counts


def split_module(
    lightning_module: Any,
    *,
    module_name: str,
    frontend: str,
    blocks: str,
    split_points: Sequence[str] | None,
    balance: str | Sequence[int],
    pipeline_size: int,
    pipeline_rank: int,
    stages_per_rank: int,
    schedule: str,
    microbatches: Any,
    microbatch_size: int | None,
    device: torch.device,
    agree: Callable[[Any], Any] = lambda value: value,
    announce: Callable[[str], None] = lambda text: None,
) -> Split:
    """Cut the LightningModule's network down to this rank's stages (in place), or return the cut made before.

    ``agree(value)`` returns global rank 0's ``value`` on every rank; ``announce(text)`` prints on rank 0.
    """
    settings = (
        module_name,
        frontend,
        blocks,
        split_points,
        balance if isinstance(balance, str) else tuple(balance),
        pipeline_size,
        pipeline_rank,
        stages_per_rank,
        schedule,
    )
    existing = lightning_module.__dict__.get(SPLIT_ATTR)
    if existing is not None:
        check_same_split(existing.settings, settings)
        return existing
    attr, network = resolve_module(lightning_module, module_name)
    num_stages = pipeline_size * stages_per_rank
    plan = (
        _frontend(network, blocks)
        if frontend != "trace"
        else _Frontend(find_layout(network, blocks), None, call_traced)
    )
    layout = plan.layout
    if len(layout.blocks) < num_stages:
        raise PipelineConfigError(
            f"The pipeline needs {num_stages} stages ({pipeline_size} ranks x {stages_per_rank} stages per rank) but"
            f" the network has only {len(layout.blocks)} blocks; every stage needs at least one. Use fewer processes"
            " per pipeline (`pipeline_size`), fewer `stages_per_rank`, or a deeper model."
        )
    if frontend == "trace" and isinstance(balance, str):
        # Traced stages are cut at block boundaries, so every stage needs a block of its own; the even split does.
        balance = "blocks"
    counts = _counts(
        lightning_module,
        network,
        layout,
        num_stages,
        split_points,
        balance,
        microbatches,
        microbatch_size,
        device,
        agree,
        announce,
    )
    units_per_stage = stage_units(layout, counts)
    ranks = stage_to_rank(num_stages, pipeline_size, "v" if schedule in V_SHAPED else "loop")
    local = [s for s in range(num_stages) if ranks[s] == pipeline_rank]
    seed = torch.initial_seed()
    absent = {s: tuple(u for u in layout.units if u not in units_per_stage[s]) for s in local}
    if frontend == "trace":
        ties = plan_ties(network, layout.units, units_per_stage)
        split = _trace(lightning_module, attr, network, layout, counts, local, microbatches, microbatch_size, device)
        split.settings, split.stage_ranks, split.absent, split.ties = settings, ranks, absent, ties
        _retie_traced(split.bodies, ties)
        if has_meta_tensors(split.network):
            initialize(split.network, device, seed, units=(), owner=lightning_module)
    else:
        check_ownership(network, layout.units)
        ties = plan_ties(network, layout.units, units_per_stage)
        full_bytes = _tensor_bytes(network)
        meta = has_meta_tensors(network)
        construction_peak = None
        keep = [u for s in local for u in units_per_stage[s]]
        prune(network, keep, layout.units, placeholder=plan.placeholder)
        if meta:
            with PeakMemory(device) as peak:
                initialize(network, device, seed, units=layout.units, owner=lightning_module)
            construction_peak = peak.bytes
        elif num_stages > 1:
            warn_whole_model(full_bytes, _tensor_bytes(network))
        # Views share the kept units (and their parameters) with `network`; made before the interceptor is installed
        # so that they keep the network's own forward.
        bodies = {s: stage_view(network, units_per_stage[s], layout.units, placeholder=plan.placeholder) for s in local}
        split = Split(settings, num_stages, ranks, bodies, absent, plan.stage_call, network, attr, ties=ties)
        split.construction_peak = construction_peak
    split.layout, split.units_per_stage = layout, units_per_stage
    split.block_names = layout.blocks
    lightning_module.__dict__[SPLIT_ATTR] = split
    return split


def _tensor_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _trace(
    lightning_module: Any,
    attr: str,
    network: nn.Module,
    layout: Layout,
    counts: list[int],
    local: list[int],
    microbatches: Any,
    microbatch_size: int | None,
    device: torch.device,
) -> Split:
    if not attr:
        raise PipelineModelError(
            "`frontend='trace'` needs the network in an attribute of the LightningModule (e.g. `self.model`),"
            " not layers defined on the LightningModule itself. Set `module=` to that attribute."
        )
    num_stages = len(counts)
    args, kwargs = _example_microbatch(lightning_module, microbatches, microbatch_size, num_stages)
    static = batch_size((args, kwargs))
    if has_meta_tensors(network):
        args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    state_keys = set(network.state_dict().keys())
    starts = [sum(counts[:s]) for s in range(1, num_stages)]
    traced = trace_stages(network, args, kwargs, [layout.blocks[i] for i in starts])
    bodies = {s: traced[s] for s in local}
    for body in bodies.values():
        retarget_meta_constants(body, device)
    holder = merge(list(bodies.values()), state_keys)
    setattr(lightning_module, attr, holder)
    return Split((), num_stages, [], bodies, {}, call_traced, holder, attr, static)


def is_split(lightning_module: Any) -> bool:
    """Whether :func:`split_module` already cut this LightningModule down to a rank's stages."""
    return SPLIT_ATTR in lightning_module.__dict__


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


def check_same_split(before: tuple, now: tuple) -> None:
    if before != now:
        raise PipelineConfigError(
            "This LightningModule was already split for another pipeline (module, frontend, blocks, split_points,"
            f" balance, pipeline_size, pipeline_rank, stages_per_rank, schedule = {before}, now {now}). The split"
            " happens in place and cannot be redone: use the same strategy settings, or a new LightningModule"
            " instance (loading a checkpoint into it) for another layout."
        )


def stage_modules(split: Split, book: CallBook) -> dict[int, StageModule]:
    """Runnable stages for ``split``, reading their side inputs from ``book`` (made on the first call, rebound to
    ``book`` on later ones)."""
    if split.stages is None:
        split.stages = {
            s: StageModule(body, s, split.num_stages, book, split.stage_call, split.absent.get(s, ()))
            for s, body in split.bodies.items()
        }
    for stage in split.stages.values():
        stage.bind(book)
    return dict(split.stages)
