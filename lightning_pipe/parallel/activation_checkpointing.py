"""Activation checkpointing of pipeline blocks, without changing a parameter name.

A checkpointed block keeps only its inputs during the forward and recomputes its activations in the backward.
Wrapper modules (``torch.distributed.algorithms._checkpoint``'s ``CheckpointWrapper``) would insert a level into
every parameter's name (``layers.3._checkpoint_wrapped_module.fc1.weight``), which breaks checkpoints and resharding.
Here the block itself stays where it is: an instance-level ``forward`` calls the class's ``forward`` through
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. Hooks registered on the block still run once per call
(``__call__`` is unchanged); hooks of its submodules run again during recomputation.

Which blocks: the ``k``-th, ``2k``-th, ... block of the network's block stack (``every=k``), counted over the whole
stack, not per stage, so the same blocks are checkpointed whatever the pipeline layout.

Order with the other per-stage wrappers (applied by the strategy, innermost first): activation checkpointing, then
``torch.compile``, then data-parallel wrapping. Checkpointing must see the plain block forward to recompute it;
compiling afterwards traces the checkpoint region as one unit; FSDP/DDP wrap the stage last because they own the
parameters and their gradient hooks, which checkpointing must not duplicate.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_pipe.split.surgery import find_block

_MARK = "_lightning_pipe_checkpointed"


def checkpointed_blocks(block_names: Sequence[str], every: int) -> list[str]:
    """The blocks to checkpoint: the ``every``-th, ``2 * every``-th, ... of ``block_names`` (none when 0)."""
    if every <= 0:
        return []
    return [name for i, name in enumerate(block_names) if (i + 1) % every == 0]


def _checkpointed_forward(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    # The class's forward, not `block.forward`, which is this function: calling it would recurse.
    return checkpoint(type(block).forward, block, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(stage_module: nn.Module, block_names: Sequence[str], every: int) -> list[str]:
    """Checkpoint the blocks of ``block_names`` chosen by ``every`` that ``stage_module`` holds; return their names.

    ``block_names`` are all the network's blocks (``Layout.blocks``), relative to ``stage_module``; blocks that
    other stages own (removed or ``None``) are skipped. Applying twice changes nothing.
    """
    wrapped = []
    for name in checkpointed_blocks(block_names, every):
        block = find_block(stage_module, name)
        if block is None:
            continue
        if not getattr(block, _MARK, False):
            # An instance attribute shadows the class's forward; nn.Module.__call__ looks it up on the instance.
            block.forward = functools.partial(_checkpointed_forward, block)
            setattr(block, _MARK, True)
        wrapped.append(name)
    return wrapped


def remove_activation_checkpointing(module: nn.Module) -> None:
    """Undo :func:`apply_activation_checkpointing` on every block of ``module``."""
    for sub in module.modules():
        if getattr(sub, _MARK, False):
            del sub.forward
            delattr(sub, _MARK)
