"""Deprecated: a PEFT model's adapter directories are the peft kind's files, :mod:`lightning_pipe.models.peft_io`,
loaded per rank by :func:`lightning_pipe.checkpoint.adapters.load_adapters`. This module keeps the old names
working."""

from __future__ import annotations

import warnings

from lightning_pipe.checkpoint.adapters import load_adapters
from lightning_pipe.models.peft_io import (
    ADAPTER_BIN,
    ADAPTER_CONFIG,
    ADAPTER_SAFETENSORS,
    COMPARED,
    adapter_directory,
    check_config,
    saved_name,
)

__all__ = [
    "ADAPTER_BIN",
    "ADAPTER_CONFIG",
    "ADAPTER_SAFETENSORS",
    "COMPARED",
    "adapter_directory",
    "check_config",
    "load_adapters",
    "saved_name",
]

warnings.warn(
    "lightning_pipe.checkpoint.peft_adapters moved to lightning_pipe.models.peft_io (reading) and"
    " lightning_pipe.checkpoint.adapters (load_adapters); import them from there.",
    DeprecationWarning,
    stacklevel=2,
)
