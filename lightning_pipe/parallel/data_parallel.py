"""Data parallelism across pipeline replicas: ``"ddp"`` (replicated stages, bucketed all-reduce) or ``"fsdp"``
(FSDP2 ``fully_shard`` over the mesh's ``"dp"`` axis).

``"ddp"`` keeps every stage's parameters, gradients and optimizer state whole on each replica; gradients are averaged
once per optimizer step by :class:`~lightning_pipe.parallel.grads.GradientSync` (buckets of at most ``bucket_bytes``).

``"fsdp"`` shards each stage over its replicas: every block of the stage is one ``fully_shard`` unit, and the stage
module is the root unit holding the rest (the embedding on the first stage, norm and head on the last). Parameters,
gradients and optimizer state are DTensors sharded on dim 0 over ``"dp"``; names do not change. A unit's parameters
are gathered (all-gather) at its first forward of a schedule step and stay whole until the step's end. torch's
``PipelineStage`` recognises the FSDP root and runs the reduce-scatter itself once all microbatches of a schedule step
went backward (one per unit: the units are the buckets);
:meth:`~lightning_pipe.strategy.PipelineParallelStrategy.block_backward_sync` defers it, with the unsharded gradients,
to the last batch of an accumulation window.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from lightning_pipe.comm import collectives
from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.split.surgery import find_block

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def shard_stage(stage_module: nn.Module, block_names: Sequence[str], mesh: DeviceMesh) -> list[str]:
    """``fully_shard`` the blocks of ``block_names`` that ``stage_module`` holds, then ``stage_module`` as the root
    unit; return the sharded blocks' names.

    ``mesh`` is the one-axis ``"dp"`` mesh. No unit reshards after its forward: a schedule step keeps the stage's
    parameters gathered from its first forward to the reduce-scatter after its last backward (as torchtitan does with
    pipelining). The split-backward schedules need it: their weight gradients of a microbatch are computed after later
    microbatches' forwards, against the gathered parameters. :func:`reshard` frees them after an evaluation step.
    """
    from torch.distributed.fsdp import fully_shard

    sharded = []
    for name in block_names:
        block = find_block(stage_module, name)
        if block is not None:
            fully_shard(block, mesh=mesh, reshard_after_forward=False)
            sharded.append(name)
    fully_shard(stage_module, mesh=mesh, reshard_after_forward=False)
    return sharded


def reshard(stages: Iterable[nn.Module]) -> None:
    """Free the gathered parameters of every FSDP unit of ``stages`` (after a forward-only step, which has no backward
    to do it), so that the optimizer, checkpoints and the next step find the sharded parameters registered."""
    from torch.distributed.fsdp import FSDPModule

    for stage in stages:
        for module in stage.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def check_token_weighting(
    settings: PipelineSettings,
    grad_scale: float | None,
    group: Any = None,
    window: str | None = None,
    group_of: Callable[[], Any] | None = None,
) -> None:
    """Refuse a token-weighted step (``num_items``, whose gradients are scaled by ``grad_scale``) that FSDP would
    average wrongly.

    FSDP reduce-scatters the replicas' unsharded gradients (each its replica's sum over its items) inside the
    schedule step, before the step's ``1 / num_items`` is known, and the scale then applies to the averaged shards. That
    is each replica's item mean, averaged over the replicas as under ``ddp``, only where every replica counted the same
    items in the step (checked over the data-parallel ``group``: one all-gather of a number per such step); otherwise
    each shard would be scaled by its own replica's count. Inside an accumulation ``window`` (what accumulates the
    step with the batches before it, e.g. ``"`accumulate_grad_batches=2`"``) FSDP sums the window's unsharded
    gradients before any batch's count is known at all. ``group_of``: returns ``group``, read only for such a step
    (a front end calls this at every training step).
    """
    if grad_scale is None or not settings.sharded:
        return
    if group_of is not None:
        group = group_of()
    if window is not None:
        raise PipelineConfigError(
            f"`data_parallel='fsdp'` with {window} cannot weight a step's gradients by the `num_items` the step"
            " returned: FSDP sums the window's unsharded gradients before any batch's item count is known. Use"
            " `data_parallel='ddp'`, or one batch per optimizer step with a larger batch (more microbatches), or"
            " return the loss without `num_items`."
        )
    if group is None:
        return
    counts = [round(float(c)) for c in collectives.all_gather(torch.tensor([1.0 / grad_scale]), group)]
    if len(set(counts)) > 1:
        raise PipelineConfigError(
            f"`data_parallel='fsdp'` cannot weight this step's gradients by the `num_items` the step returned: the"
            f" data-parallel replicas counted different items ({counts}), and FSDP averages the replicas' gradients"
            " before a replica's `1 / num_items` can apply, so each parameter shard would be scaled by its own"
            " replica's count. Use `data_parallel='ddp'` (each replica's item mean, averaged over the replicas as"
            " Lightning's DDP does), or return the loss without `num_items`."
        )


def parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The trainable parameters of ``modules`` as they are now (each once)."""
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for p in module.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())
