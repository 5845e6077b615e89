"""Deprecated: a PEFT model's export is the peft kind's files, :mod:`lightning_pipe.models.peft_io`, reached through
:func:`lightning_pipe.checkpoint.export.export`. This module keeps the old names working."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_pipe.checkpoint.export import checkpoint_entries, write_directory
from lightning_pipe.models import peft_io
from lightning_pipe.models.peft_io import PEFT, READ_BYTES, refuse_not_peft, refuse_plain_export

__all__ = ["PEFT", "READ_BYTES", "export", "refuse_not_peft", "refuse_plain_export"]

warnings.warn(
    "lightning_pipe.checkpoint.peft_export moved to lightning_pipe.models.peft_io; export with"
    " lightning_pipe.checkpoint.export.export(..., adapter=True) or merge=True.",
    DeprecationWarning,
    stacklevel=2,
)


def export(src: Path, dst: Path, record: Mapping[str, Any], *args: Any, **kwargs: Any) -> Path:
    """:func:`lightning_pipe.models.peft_io.export` (``args``, ``kwargs``: its arguments after ``out``) of the
    checkpoint ``src`` with the network record ``record``, written to ``dst`` complete or not at all."""
    entries = dataclasses.replace(checkpoint_entries(Path(src)), record=record)
    return write_directory(Path(dst), lambda out: peft_io.export(entries, out, *args, **kwargs))
