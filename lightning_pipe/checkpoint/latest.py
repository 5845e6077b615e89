"""The newest complete checkpoint in a set of directories: what a restarted run resumes from.

Pure file-system reads, no process group: every rank finds the same answer from the same directories (they must be on
a file system every rank sees, as for loading any checkpoint). A directory counts only when it is complete: its
manifest exists (written last), and every file the manifest and the shard metadata name is there at full length. The
newest is the one with the highest ``global_step`` (then the latest save). A save killed after its manifest was
written but before its rename (docs/checkpoints.md) counts too, and is given its name before it is loaded: a complete
``<name>.tmp-<id>`` replaces an older ``<name>``, and a ``<name>.old-<id>`` left without its successor is renamed
back.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lightning_pipe.checkpoint import format as fmt
from lightning_pipe.compat import torch as torch_compat
from lightning_pipe.errors import PipelineCheckpointError


@dataclass(frozen=True)
class Found:
    """A complete checkpoint directory and how far its run had trained."""

    path: Path
    global_step: int
    epoch: int
    saved_at: float

    @property
    def order(self) -> tuple[int, float]:
        return self.global_step, self.saved_at


def inspect_complete(path: Path) -> Optional[Found]:
    """``path`` as a :class:`Found` if it is a complete checkpoint directory, else ``None`` (never raises for an
    incomplete, foreign or unreadable directory: a restart must not fail on what a killed save left)."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    try:
        manifest = _manifest(path)
        if manifest is None:
            return None
        metadata = dcp.FileSystemReader(path).read_metadata() if (path / fmt.DCP_METADATA).is_file() else None
        ends = torch_compat.storage_extents(metadata) if metadata is not None else []
        if metadata is None or fmt.missing_files(path, manifest, ends):
            return None
        step, epoch = progress(path, manifest)
        return Found(path, step, epoch, float(manifest.get(fmt.SAVED_AT, (path / fmt.MANIFEST).stat().st_mtime)))
    except (PipelineCheckpointError, OSError, ValueError, RuntimeError, KeyError, EOFError):
        return None


def _manifest(path: Path) -> Optional[dict[str, Any]]:
    """The manifest of ``path`` if it is one this version reads (a transient directory's too, which
    ``fmt.read_manifest`` refuses by name: here it is a candidate to finish), else ``None``."""
    try:
        manifest = json.loads((path / fmt.MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    readable = isinstance(manifest, dict) and manifest.get("format") == fmt.FORMAT_NAME
    return manifest if readable and manifest.get("version") == fmt.FORMAT_VERSION else None


def progress(path: Path, manifest: dict[str, Any]) -> tuple[int, int]:
    """``(global_step, epoch)`` at save time: from the manifest, or (checkpoints written before it recorded them) from
    the trainer state file."""
    if fmt.GLOBAL_STEP in manifest:
        return int(manifest[fmt.GLOBAL_STEP]), int(manifest.get(fmt.EPOCH, 0))
    import torch

    state = torch.load(path / fmt.TRAINER_STATE, map_location="cpu", weights_only=False)
    return int(state.get("global_step", 0)), int(state.get("epoch", 0))


def candidates(directories: Iterable[Path]) -> list[Path]:
    """Every directory (or link to one) directly inside ``directories`` that may hold a checkpoint: committed ones, a
    save's temporary directory, and a replaced checkpoint whose successor is missing."""
    found: list[Path] = []
    for directory in directories:
        directory = Path(directory)
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if not path.is_dir() or fmt.is_trash(path):
                continue
            if fmt.is_transient(path) and not fmt.is_temporary(path) and fmt.checkpoint_name(path).exists():
                continue  # a replaced checkpoint whose successor is in place
            found.append(path)
    return found


def newest_complete(directories: Iterable[Path]) -> Optional[Found]:
    """The complete checkpoint with the highest ``global_step`` (then the latest save) directly inside
    ``directories``; transient directories that hold a complete save are finished first (see the module docstring).
    ``None`` when there is none."""
    best: Optional[Found] = None
    for path in candidates(directories):
        found = inspect_complete(path)
        if found is not None and (best is None or found.order > best.order):
            best = found
    if best is not None and fmt.is_transient(best.path):
        best = Found(finish_interrupted(best.path), best.global_step, best.epoch, best.saved_at)
    return best


def finish_interrupted(path: Path) -> Path:
    """Give the complete transient directory ``path`` its checkpoint name: a ``.tmp-`` one replaces an older
    checkpoint of that name (kept aside as ``.old-`` until then), an ``.old-`` one comes back when the name is free.
    Returns the checkpoint's name (``path`` itself if the name is taken by a newer checkpoint)."""
    final = fmt.checkpoint_name(path)
    if fmt.is_temporary(path):
        token = path.name.rsplit("-", 1)[1]
        if final.exists():
            old = fmt.replaced_path(final, token)
            os.rename(final, old)
            os.rename(path, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(path, final)
        return final
    os.rename(path, final)  # a replaced checkpoint whose successor never arrived (candidates() checked the name)
    return final
