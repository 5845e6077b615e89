"""Per-stage wrappers, applied once per stage in one fixed order: tensor parallelism, activation checkpointing,
compile, FSDP."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_pipe.comm import collectives
from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.parallel import data_parallel
from lightning_pipe.parallel.activation_checkpointing import (
    apply_activation_checkpointing,
    remove_activation_checkpointing,
)
from lightning_pipe.parallel.compile import apply_compile, check_compiler, remove_compile, stage_device
from lightning_pipe.parallel.tensor_parallel import TensorParallel, TensorParallelDone

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class Wrapped:
    """What :func:`wrap_stages` did on this rank."""

    #: names (relative to the network) of the blocks whose activations are recomputed in backward
    checkpointed: list[str] = field(default_factory=list)
    #: names (relative to the network) of the blocks compiled with ``torch.compile`` (``""``: a whole stage body)
    compiled: list[str] = field(default_factory=list)
    #: names of the blocks that are FSDP units of their own (empty without FSDP)
    sharded_blocks: list[str] = field(default_factory=list)
    #: the global ranks the stages are sharded over with FSDP (parameters are sharded DTensors), or ``None``
    sharded_over: tuple[int, ...] | None = None
    #: what tensor parallelism did (``None`` without it)
    tensor_parallel: TensorParallelDone | None = None

    @property
    def sharded(self) -> bool:
        return self.sharded_over is not None


def wrap_stages(
    stages: Mapping[int, nn.Module],
    block_names: Sequence[str],
    *,
    checkpoint_every: int,
    compile_options: dict[str, Any] | None = None,
    dp_mesh: DeviceMesh | None,
    sharded_over: tuple[int, ...] | None,
    tensor_parallel: TensorParallel | None = None,
) -> Wrapped:
    """Wrap each of this rank's stage modules (:class:`~lightning_pipe.step.stage.StageModule`, whose ``body`` holds
    the blocks under their network names); ``dp_mesh`` (the ``"dp"`` axis) shards them with FSDP, ``None`` not;
    ``tensor_parallel`` (with ``tensor_parallel > 1``) splits their layers over the ``"tp"`` axis first.

    The order is fixed, innermost first (torchtitan's: split the model into stages, then TP, AC, compile, FSDP):

    1. tensor parallelism: it changes what a layer computes on a rank (its part of the features) and replaces the
       layer's parameters by DTensors; everything after must see the split layers. The user's own plan was applied in
       ``configure_model``, before this function; a Hugging Face model's plan is applied here, then ties are
       restored and the meshes checked (:class:`~lightning_pipe.parallel.tensor_parallel.TensorParallel`);
    2. activation checkpointing: it must see each block's plain (tensor-parallel) forward, to recompute exactly that
       in backward, collectives included;
    3. ``torch.compile`` of each block (``compile_options``, ``None``: off): it traces the checkpointed block as one
       region, and stays inside the FSDP hooks;
    4. FSDP last: it owns the parameters (swapping in DTensors sharded over "dp" as well as "tp") and hooks each
       block's forward and backward to all-gather them, so the recomputation inside a checkpointed block runs on
       gathered parameters and the gradient hooks are FSDP's alone.

    Activation checkpointing and compilation are undone by :func:`unwrap_stages` when the Trainer entry ends. FSDP
    cannot be taken off a module in place: ``sharded_over`` (the ranks an earlier entry sharded the stages over, or
    ``None``) must match what this entry asks for.
    """
    wanted = None if dp_mesh is None else tuple(collectives.group_ranks(dp_mesh.get_group()))
    if sharded_over is not None and wanted != sharded_over:
        raise PipelineConfigError(
            f"An earlier Trainer sharded this LightningModule's stages with FSDP over ranks {list(sharded_over)};"
            f" this one asks for {'no sharding' if wanted is None else f'sharding over ranks {list(wanted)}'}. FSDP"
            " cannot be taken off a module in place. Use the same `data_parallel='fsdp'` layout, or a new"
            " LightningModule instance (load the checkpoint into it) for another one."
        )
    done = Wrapped(sharded_over=wanted)
    if tensor_parallel is not None:
        done.tensor_parallel = tensor_parallel.apply()
    if compile_options is not None:
        check_compiler(compile_options, stage_device(stages))
    in_stage = [f"body.{name}" for name in block_names]
    for stage in stages.values():
        done.checkpointed += apply_activation_checkpointing(stage, in_stage, checkpoint_every)
        if compile_options is not None:
            done.compiled += apply_compile(stage.get_submodule("body"), block_names, compile_options)
        if dp_mesh is not None and not data_parallel.is_sharded(stage):  # a later Trainer entry finds it sharded
            done.sharded_blocks += data_parallel.shard_stage(stage, in_stage, dp_mesh)
    done.checkpointed = [name.removeprefix("body.") for name in done.checkpointed]
    done.sharded_blocks = [name.removeprefix("body.") for name in done.sharded_blocks]
    return done


def unwrap_stages(stages: Mapping[int, nn.Module]) -> None:
    """Undo what :func:`wrap_stages` can undo (compilation, then activation checkpointing, whose forward the compiled
    one wraps), when the Trainer entry ends."""
    for stage in stages.values():
        remove_compile(stage)
        remove_activation_checkpointing(stage)
