"""Private torch names used by lightning-pipe, one function each (checked with torch 2.13).

Replace each with the public API named in its docstring once torch offers it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn


# ---------------------------------------------------------------------------------------------------- nn.Module
def children(module: nn.Module) -> dict[str, nn.Module | None]:
    """The module's child slots, ``None`` entries included (``module._modules``).

    Public ``named_children()`` skips ``None`` children and cannot be assigned to; stage surgery needs both.
    """
    return module._modules


def set_children(module: nn.Module, slots: Mapping[str, nn.Module | None]) -> None:
    """Replace the module's child slots wholesale, keeping their keys (``module._modules = ...``).

    ``del module_list[i]`` (public) renumbers the entries after ``i``; a stage must keep the full model's keys
    (``layers.5`` stays ``layers.5``), and a shallow-copied stage view must not share the slot dict of the network.
    """
    module.__dict__["_modules"] = dict(slots)


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """Parameters registered directly on ``module`` (``module._parameters``); public ``named_parameters(recurse=False)``
    would do for reading but not for re-registering the same objects under the same names on another module."""
    return module._parameters


def own_buffers(module: nn.Module) -> dict[str, Any]:
    """Buffers registered directly on ``module`` (``module._buffers``), read like :func:`own_parameters`."""
    return module._buffers


def mark_non_persistent(module: nn.Module, name: str) -> None:
    """Keep buffer ``name`` out of the state dict (``module._non_persistent_buffers_set``).

    Public: ``register_buffer(name, tensor, persistent=False)``, which would re-register the tensor; used when a merged
    module must mirror the original network's state-dict keys exactly.
    """
    module._non_persistent_buffers_set.add(name)


# ---------------------------------------------------------------------------------------------------- checkpoint
def flatten_state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """Flat ``"a.b.c"`` keys of a nested state dict, as torch.distributed.checkpoint stores them
    (``torch.distributed.checkpoint._nested_dict.flatten_state_dict``; no public equivalent in torch 2.13)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    flat, _ = flatten(dict(state))
    return flat


def storage_extents(metadata: Any) -> list[tuple[str, int]]:
    """``(file relative to the checkpoint, end offset)`` of every item a DCP checkpoint stores.

    ``Metadata.storage_data`` maps items to the private ``_StorageInfo(relative_path, offset, length)`` of the
    filesystem writer; torch 2.13 has no public reader of it. Used to detect truncated shards before loading.
    """
    return [(info.relative_path, info.offset + info.length) for info in (metadata.storage_data or {}).values()]


# ---------------------------------------------------------------------------------------------------- memory
def dispatch_mode_class() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``: sees every operator call, which is how CPU tensor bytes are
    counted (torch 2.13 has no CPU allocator statistic; ``torch.cuda.max_memory_allocated`` serves CUDA). Private
    module, but the mode is the documented ``__torch_dispatch__`` extension point."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


# ---------------------------------------------------------------------------------------------------- schedules
def schedule_actions(schedule: str, pipeline_size: int, microbatches: int, stages_per_rank: int) -> list[list[tuple]]:
    """Each pipeline rank's compute actions, in the order torch's schedule runs them: ``(stage, kind, microbatch)``
    with kind ``"F"`` (forward), ``"B"`` (full backward), ``"I"`` (input-gradient backward) or ``"W"`` (weight-gradient
    backward); a DualPipeV ``OVERLAP_F_B`` action becomes its forward then its backward.

    ``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops`` builds the schedule on mock stages, so the
    schedule's own checks run: an invalid combination (1F1B with fewer microbatches than stages, DualPipeV with fewer
    than twice the ranks, ZBV with other than 2 stages per rank) raises ``ValueError``. torch 2.13 has no public way
    to read a schedule's action order.
    """
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    try:
        ops = get_schedule_ops(schedule, pipeline_size, microbatches, stages_per_rank)
    except AssertionError as err:  # the visualizer asserts the stages-per-rank rule of single/multi-stage schedules
        raise ValueError(str(err)) from None
    return [[action for op in rank if op is not None for action in _split_action(op)] for rank in ops]


def _split_action(op: Any) -> list[tuple]:
    kind = str(op.computation_type.value)  # torch's _ComputationType is a str enum: "F", "I", "OVERLAP_F_B", ...
    if op.sub_actions:  # OVERLAP_F_B: (forward; backward) of two stages, run one after the other
        return [action for sub in op.sub_actions for action in _split_action(sub)]
    if kind not in ("F", "B", "I", "W"):
        return []  # communication, resharding, gradient reduction: not compute
    return [(op.stage_index, kind, op.microbatch_index)]
