"""Deprecated: ``export-hf`` is :func:`lightning_pipe.checkpoint.export.export` (any kind's format), the transformers
format :mod:`lightning_pipe.models.huggingface.export`. This module keeps the old names working."""

from __future__ import annotations

import warnings

from lightning_pipe.checkpoint.export import export
from lightning_pipe.models.files import DEFAULT_SHARD_SIZE, DTYPES
from lightning_pipe.models.huggingface.export import (
    INDEX,
    READ_BYTES,
    Entry,
    meta_model,
    parse_size,
    plan_entries,
    plan_shards,
    safetensors_header,
    shard_files,
    write_tensor,
)

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "DTYPES",
    "INDEX",
    "READ_BYTES",
    "Entry",
    "export",
    "meta_model",
    "parse_size",
    "plan_entries",
    "plan_shards",
    "safetensors_header",
    "shard_files",
    "write_tensor",
]

warnings.warn(
    "lightning_pipe.checkpoint.hf_export moved: export with lightning_pipe.checkpoint.export.export, the transformers"
    " format is lightning_pipe.models.huggingface.export.",
    DeprecationWarning,
    stacklevel=2,
)
