"""Per-stage wrappers, applied once per stage in one fixed order: activation checkpointing, (compile), FSDP."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from lightning_pipe import data_parallel
from lightning_pipe.checkpointing import apply_activation_checkpointing

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class Wrapped:
    """What :func:`wrap_stages` did on this rank."""

    #: names (relative to the network) of the blocks whose activations are recomputed in backward
    checkpointed: list[str] = field(default_factory=list)
    #: names of the blocks that are FSDP units of their own (empty without FSDP)
    sharded_blocks: list[str] = field(default_factory=list)
    #: whether the stages are FSDP roots (parameters are sharded DTensors)
    sharded: bool = False


def wrap_stages(
    stages: Mapping[int, nn.Module],
    block_names: Sequence[str],
    *,
    checkpoint_every: int,
    dp_mesh: DeviceMesh | None,
) -> Wrapped:
    """Wrap each of this rank's stage modules (:class:`~lightning_pipe.side_inputs.StageModule`, whose ``body`` holds
    the blocks under their network names); ``dp_mesh`` (the ``"dp"`` axis) shards them with FSDP, ``None`` not.

    The order is fixed, innermost first:

    1. activation checkpointing: it must see each block's plain forward, to recompute exactly that in backward;
    2. ``torch.compile`` (not applied yet): it would trace the checkpointed block as one region;
    3. FSDP last: it owns the parameters (swapping in sharded DTensors) and hooks each block's forward and backward
       to all-gather them, so the recomputation inside a checkpointed block runs on gathered parameters and the
       gradient hooks are FSDP's alone.
    """
    done = Wrapped()
    in_stage = [f"body.{name}" for name in block_names]
    for stage in stages.values():
        done.checkpointed += apply_activation_checkpointing(stage, in_stage, checkpoint_every)
        if dp_mesh is not None and not data_parallel.is_sharded(stage):  # a later Trainer entry finds it sharded
            done.sharded_blocks += data_parallel.shard_stage(stage, in_stage, dp_mesh)
        done.sharded = done.sharded or data_parallel.is_sharded(stage)
    done.checkpointed = [name.removeprefix("body.") for name in done.checkpointed]
    done.sharded_blocks = [name.removeprefix("body.") for name in done.sharded_blocks]
    return done
