"""``torch.compile`` per block (``compile=True``), without changing a parameter name.

Each block of a stage is compiled on its own, as torchtitan does: blocks of one class share their compiled code (torch
guards on the block's class and tensor shapes, not on which block it is), so a stage of eight blocks compiles one
graph, and a graph break stays inside one block. ``torch.compile(block)`` would return a wrapper module that inserts
``_orig_mod`` into every parameter name; here the block stays where it is and its instance-level ``forward`` becomes
the compiled one (the forward that activation checkpointing installed, when it did: the checkpoint region is traced as
one unit). Hooks on the block (FSDP's) stay outside the compiled code. A stage that holds none of the named blocks (a
traced stage, whose graph calls no block module) has its whole ``forward`` compiled instead. Undone when the Trainer
entry ends (:func:`remove_compile`).

Not with the zero-bubble schedules (``lightning_pipe.settings.SPLIT_BACKWARD``): they run each backward as two
passes over the stage's autograd graph (input gradients with ``retain_graph=True``, then weight gradients from the
saved intermediate gradients), and a compiled region's backward is one autograd node that computes both at once and
frees its saved tensors after one use. torch 2.13 refuses wrapped compiled stages under them
(``_check_torch_compile_compatibility``); a block compiled in place would fail in its first backward. The settings
refuse the combination before any process starts.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.split.surgery import find_block

_MARK = "_lightning_pipe_compiled"


def check_compiler(options: Mapping[str, Any], device: torch.device) -> None:
    """Inductor (the default backend) generates C++ for the CPU: without a compiler the first step would fail deep
    inside torch, so fail now with the fix."""
    backend = options.get("backend", "inductor")
    if device.type != "cpu" or backend != "inductor":
        return
    compilers = [os.environ.get("CXX", ""), "g++", "clang++", "c++"]
    if not any(name and shutil.which(name) for name in compilers):
        raise PipelineConfigError(
            "`compile` on the CPU uses torch's inductor backend, which compiles C++ and needs a C++ compiler (g++,"
            " clang++ or $CXX); none was found. Install one, or pass `compile={'backend': 'aot_eager'}` (traced,"
            " not code-generated)."
        )


def stage_device(stages: Mapping[int, nn.Module]) -> torch.device:
    """Where the stages' parameters live (they are moved to the rank's device before they are wrapped)."""
    for stage in stages.values():
        for tensor in stage.parameters():
            return tensor.device
    return torch.device("cpu")


def apply_compile(stage_module: nn.Module, block_names: Sequence[str], options: Mapping[str, Any]) -> list[str]:
    """Compile the blocks of ``block_names`` that ``stage_module`` holds (names relative to it); return their names.

    Without any of them, the stage module's own forward is compiled (and ``[""]`` returned). Applying twice changes
    nothing.
    """
    found = [(name, block) for name in block_names if (block := find_block(stage_module, name)) is not None]
    if not found:
        found = [("", stage_module)]
    for _, block in found:
        if _MARK not in vars(block):
            # The instance's forward when one is set (activation checkpointing's), else the class's, bound.
            previous = vars(block).get("forward")
            block.forward = torch.compile(block.forward, **options)
            # Stored in a list: nn.Module.__setattr__ would register a module-valued or parameter-valued attribute.
            vars(block)[_MARK] = [previous]
    return [name for name, _ in found]


def remove_compile(module: nn.Module) -> None:
    """Undo :func:`apply_compile` on ``module`` and every submodule: each gets back the forward it had before."""
    for sub in module.modules():
        mark = vars(sub).pop(_MARK, None)
        if mark is None:
            continue
        previous = mark[0]
        if previous is None:
            del sub.forward
        else:
            sub.forward = previous


def compiled_blocks(module: nn.Module) -> list[str]:
    """Names (relative to ``module``) of the submodules whose forward :func:`apply_compile` compiled."""
    return [name for name, sub in module.named_modules() if _MARK in vars(sub)]
