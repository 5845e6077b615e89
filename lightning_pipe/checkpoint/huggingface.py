"""Deprecated: Hugging Face model directories are the transformers kind's files, in
:mod:`lightning_pipe.models.huggingface.directory` (read per rank by :func:`lightning_pipe.checkpoint.io.
load_pretrained`). This module keeps the old names working."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from lightning_pipe.checkpoint import format as fmt
from lightning_pipe.checkpoint.io import PRECISION_DTYPES, pretrained_files, tie_groups
from lightning_pipe.comm.dtensor import assign_whole_
from lightning_pipe.models import kind_of
from lightning_pipe.models.files import Assign, LoadPlan, load_mapped
from lightning_pipe.models.huggingface import directory
from lightning_pipe.models.huggingface.directory import (
    BIN,
    BIN_INDEX,
    CONFIG,
    GENERATION_CONFIG,
    OTHER_FORMATS,
    READ_BYTES,
    SAFETENSORS,
    SAFETENSORS_INDEX,
    WEIGHT_FILES,
    Directory,
    Piece,
    matching,
    mismatch_message,
    new_head_message,
    pieces,
    read_directory,
    resolve_names,
    stored_names,
    stored_shapes,
)
from lightning_pipe.models.huggingface.files import HuggingFaceFiles

__all__ = [
    "BIN",
    "BIN_INDEX",
    "CONFIG",
    "GENERATION_CONFIG",
    "OTHER_FORMATS",
    "PRECISION_DTYPES",
    "READ_BYTES",
    "RECORD",
    "SAFETENSORS",
    "SAFETENSORS_INDEX",
    "WEIGHT_FILES",
    "Directory",
    "LoadPlan",
    "Piece",
    "copy_into",
    "is_hf_directory",
    "load_mapped",
    "matching",
    "mismatch_message",
    "new_head_message",
    "pieces",
    "plan_load",
    "read_directory",
    "resolve_names",
    "stored_names",
    "stored_shapes",
]

warnings.warn(
    "lightning_pipe.checkpoint.huggingface moved to lightning_pipe.models.huggingface.directory (the transformers"
    " kind's files); import it from there.",
    DeprecationWarning,
    stacklevel=2,
)

#: Manifest key of a checkpoint's network record: what ``export-hf`` needs (the model kind's ``record``).
RECORD = fmt.NETWORK_RECORD


def is_hf_directory(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face model directory (a config or weights file; no lightning-pipe manifest)."""
    return isinstance(pretrained_files(Path(path)), HuggingFaceFiles)


def plan_load(
    path: Path, state: Mapping[str, Any], module: nn.Module, network_prefix: str, aliases: Mapping[str, str]
) -> LoadPlan:
    """:func:`lightning_pipe.models.huggingface.directory.plan_load` of the module's network, its ties found and
    ``aliases`` (``{name: first name}`` of parameters tied across stages) added."""
    network = module.get_submodule(network_prefix[:-1]) if network_prefix else module
    groups = tie_groups(module, aliases)
    return directory.plan_load(Path(path), state, network, kind_of(network), network_prefix, groups)


def copy_into(plan: LoadPlan, assign: Assign = assign_whole_) -> int:
    """:func:`lightning_pipe.models.huggingface.directory.copy_into`, a DTensor taking its part."""
    return directory.copy_into(plan, assign)
