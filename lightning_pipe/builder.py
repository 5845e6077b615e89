"""Where the model is split: from a LightningModule to this rank's stages and the runtime that drives them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.config import V_SHAPED
from lightning_pipe.errors import PipelineConfigError, PipelineModelError
from lightning_pipe.interception import CallInterceptor
from lightning_pipe.microbatch import batch_size
from lightning_pipe.partition import (
    Layout,
    balance_blocks,
    check_balance,
    counts_from_split_points,
    find_layout,
    stage_to_rank,
    stage_units,
)
from lightning_pipe.runtime import PipelineRuntime
from lightning_pipe.stages import (
    check_ownership,
    has_meta_tensors,
    materialize,
    merge,
    prune,
    retarget_meta_constants,
    stage_view,
    trace_stages,
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


def stage_counts(
    layout: Layout, num_stages: int, split_points: Sequence[str] | None, balance: Sequence[int] | None
) -> list[int]:
    """Blocks per stage from ``split_points``, ``balance`` or an even split."""
    if split_points is not None:
        return counts_from_split_points(layout.blocks, split_points, num_stages)
    if balance is not None:
        return check_balance(balance, len(layout.blocks), num_stages)
    return balance_blocks(len(layout.blocks), num_stages)


def _example_microbatch(
    lightning_module: Any, microbatches: Any, microbatch_size: int | None, num_stages: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    example = getattr(lightning_module, "example_input_array", None)
    if example is None:
        raise PipelineModelError(
            "`frontend='trace'` traces the network with an example input: set `self.example_input_array` in the"
            " LightningModule to one full batch of network inputs (a tensor, a tuple of tensors or a dict)."
        )
    from lightning_pipe.config import resolve_microbatches
    from lightning_pipe.microbatch import batch_size, split_batch

    n = resolve_microbatches(microbatches, microbatch_size, batch_size(example), num_stages, "microbatches")
    first = split_batch(example, n)[0]
    if isinstance(first, dict):
        return (), first
    if isinstance(first, (tuple, list)):
        return tuple(first), {}
    return (first,), {}


def build_pipeline(
    lightning_module: Any,
    *,
    module_name: str,
    frontend: str,
    blocks: str,
    split_points: Sequence[str] | None,
    balance: Sequence[int] | None,
    pipeline_size: int,
    pipeline_rank: int,
    stages_per_rank: int,
    schedule: str,
    microbatches: Any,
    microbatch_size: int | None,
    device: torch.device,
    group: dist.ProcessGroup | None,
    group_ranks: Sequence[int],
) -> PipelineRuntime:
    """Cut the LightningModule's network down to this rank's stages (in place) and return their runtime.

    A LightningModule that was already cut (``trainer.fit`` then ``trainer.test``, or a second Trainer) keeps its
    stages: the runtime built the first time is returned again, bound to the new process group.
    """
    split = (
        module_name,
        frontend,
        blocks,
        split_points,
        balance,
        pipeline_size,
        pipeline_rank,
        stages_per_rank,
        schedule,
    )
    existing = lightning_module.__dict__.get(_RUNTIME_ATTR)
    if existing is not None:
        return _reuse(existing, split, microbatches, microbatch_size, group, group_ranks)
    attr, network = resolve_module(lightning_module, module_name)
    static_microbatch_size = None
    num_stages = pipeline_size * stages_per_rank
    layout = find_layout(network, blocks)
    if len(layout.blocks) < num_stages:
        raise PipelineConfigError(
            f"The pipeline needs {num_stages} stages ({pipeline_size} ranks x {stages_per_rank} stages per rank) but"
            f" the network has only {len(layout.blocks)} blocks; every stage needs at least one. Use fewer processes"
            " per pipeline (`pipeline_size`), fewer `stages_per_rank`, or a deeper model."
        )
    counts = stage_counts(layout, num_stages, split_points, balance)
    units_per_stage = stage_units(layout, counts)
    ranks = stage_to_rank(num_stages, pipeline_size, "v" if schedule in V_SHAPED else "loop")
    local = [s for s in range(num_stages) if ranks[s] == pipeline_rank]
    seed = torch.initial_seed()

    if frontend == "trace":
        if not attr:
            raise PipelineModelError(
                "`frontend='trace'` needs the network in an attribute of the LightningModule (e.g. `self.model`),"
                " not layers defined on the LightningModule itself. Set `module=` to that attribute."
            )
        args, kwargs = _example_microbatch(lightning_module, microbatches, microbatch_size, num_stages)
        static_microbatch_size = batch_size((args, kwargs))
        meta = has_meta_tensors(network)
        if meta:
            args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
            kwargs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        state_keys = set(network.state_dict().keys())
        starts = [sum(counts[:s]) for s in range(1, num_stages)]
        traced = trace_stages(network, args, kwargs, [layout.blocks[i] for i in starts])
        stage_modules = [traced[s] for s in local]
        for mod in stage_modules:
            retarget_meta_constants(mod, device)
        holder = merge(stage_modules, state_keys)
        setattr(lightning_module, attr, holder)
        if meta:
            materialize(holder, device, seed)
        interceptor_target = holder
    else:
        check_ownership(network, layout.units, units_per_stage)
        keep = [u for s in local for u in units_per_stage[s]]
        prune(network, keep, layout.units)
        if has_meta_tensors(network):
            materialize(network, device, seed)
        # Views share the kept units (and their parameters) with `network`; made before the interceptor is installed
        # so that they keep the network's own forward.
        stage_modules = [stage_view(network, units_per_stage[s], layout.units) for s in local]
        interceptor_target = network
    interceptor = CallInterceptor(interceptor_target)
    runtime = PipelineRuntime(
        lightning_module=lightning_module,
        interceptor=interceptor,
        stage_modules=list(zip(local, stage_modules)),
        num_stages=num_stages,
        stage_ranks=ranks,
        schedule_name=schedule,
        microbatches=microbatches,
        microbatch_size=microbatch_size,
        device=device,
        group=group,
        group_ranks=group_ranks,
    )
    runtime.split = split  # type: ignore[attr-defined]
    # Traced graphs may bake the example microbatch's size into reshapes; evaluation pads to it (evaluation.py).
    runtime.static_microbatch_size = static_microbatch_size  # type: ignore[attr-defined]
    lightning_module.__dict__[_RUNTIME_ATTR] = runtime
    return runtime


_RUNTIME_ATTR = "_lightning_pipe_runtime"


def is_split(lightning_module: Any) -> bool:
    """Whether ``build_pipeline`` already cut this LightningModule down to a rank's stages."""
    return _RUNTIME_ATTR in lightning_module.__dict__


def _reuse(
    runtime: PipelineRuntime,
    split: tuple,
    microbatches: Any,
    microbatch_size: int | None,
    group: dist.ProcessGroup | None,
    group_ranks: Sequence[int],
) -> PipelineRuntime:
    if runtime.split != split:  # type: ignore[attr-defined]
        raise PipelineConfigError(
            "This LightningModule was already split for another pipeline (module, frontend, blocks, split_points,"
            f" balance, pipeline_size, pipeline_rank, stages_per_rank, schedule = {runtime.split}, now"  # type: ignore[attr-defined]
            f" {split}). The split happens in place and cannot be redone: use the same strategy settings, or a new"
            " LightningModule instance (loading a checkpoint into it) for another layout."
        )
    runtime.microbatches, runtime.microbatch_size = microbatches, microbatch_size
    runtime.group, runtime.group_ranks = group, list(group_ranks)
    runtime.last_stage_global_rank = runtime.group_ranks[runtime.stage_ranks[runtime.num_stages - 1]]
    # Cached schedules hold stages bound to the previous process group.
    runtime._schedules.clear()
    runtime.interceptor.remove()
    runtime.interceptor = CallInterceptor(runtime.interceptor._module)
    return runtime
