"""Conversion between lightning-pipe checkpoint directories and ordinary single-file Lightning checkpoints.

``consolidate``: a directory checkpoint (any pipeline layout) to one ``.ckpt`` that
``LightningModule.load_from_checkpoint`` and ``Trainer(strategy="auto")`` read. It runs in one process without a
process group and holds the full model in CPU memory (and nothing else: entries are read in chunks).

The other direction needs no conversion step: ``PipelineParallelStrategy(init_weights=path)`` starts a pipeline run
from a ``.ckpt`` or a plain ``state_dict`` file, each rank reading only its own stages.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.checkpoint import format as fmt
from lightning_pipe.compat import torch as torch_compat
from lightning_pipe.errors import PipelineCheckpointError

#: Bytes read per DCP call while consolidating: bounds the progress bar's granularity, not memory (the whole model is
#: held anyway).
CHUNK_BYTES = 256 * 2**20


def inspect(path: Path) -> dict[str, Any]:
    """The manifest and entry counts of the checkpoint directory ``path`` (checked for completeness)."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    manifest = fmt.read_manifest(path)
    metadata = dcp.FileSystemReader(path).read_metadata() if (path / fmt.DCP_METADATA).is_file() else None
    ends = torch_compat.storage_extents(metadata) if metadata else []
    problems = fmt.missing_files(path, manifest, ends)
    if problems:
        raise PipelineCheckpointError(f"Checkpoint {str(path)!r} is incomplete or corrupted: {'; '.join(problems)}.")
    assert metadata is not None
    keys = list(metadata.state_dict_metadata)
    model = [k for k in keys if k.startswith(fmt.MODEL_PREFIX)]
    return {**manifest, "model_entries": len(model), "optimizer_entries": len(keys) - len(model)}


def _chunks(metadata: Any, keys: list[str], limit: int) -> Iterator[tuple[list[str], int]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    chunk: list[str] = []
    size = 0
    for key in keys:
        meta = metadata.state_dict_metadata[key]
        nbytes = 0
        if isinstance(meta, TensorStorageMetadata):
            nbytes = meta.size.numel() * torch.empty((), dtype=meta.properties.dtype).element_size()
        if chunk and size + nbytes > limit:
            yield chunk, size
            chunk, size = [], 0
        chunk.append(key)
        size += nbytes
    if chunk:
        yield chunk, size


def load_model_weights(path: Path, progress: bool = False, chunk_bytes: int = CHUNK_BYTES) -> dict[str, Any]:
    """Read every model entry of the checkpoint directory ``path`` into one ``state_dict`` (full names, CPU)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from tqdm import tqdm

    info = inspect(path)
    reader_meta = dcp.FileSystemReader(path).read_metadata()
    keys = [k for k in reader_meta.state_dict_metadata if k.startswith(fmt.MODEL_PREFIX)]
    chunks = list(_chunks(reader_meta, keys, chunk_bytes))
    weights: dict[str, Any] = {}
    total = sum(size for _, size in chunks)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="consolidating", disable=not progress, file=sys.stderr
    ) as bar:
        for chunk, size in chunks:
            target: dict[str, Any] = {}
            for key in chunk:
                meta = reader_meta.state_dict_metadata[key]
                name = key[len(fmt.MODEL_PREFIX) :]
                if isinstance(meta, TensorStorageMetadata):
                    target[name] = torch.empty(meta.size, dtype=meta.properties.dtype)
                else:
                    target[name] = None  # DCP replaces a non-tensor entry by its stored value
            state = {"state_dict": target}
            with warnings.catch_warnings():
                # "assuming the intent is to load in a single process": it is.
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
            weights.update(state["state_dict"])
            bar.update(size)
    if len(weights) != info["model_entries"]:
        raise PipelineCheckpointError(f"Read {len(weights)} of {info['model_entries']} model entries from {path}.")
    return weights


def consolidate(src: Path, dst: Path, progress: bool = False, weights_only: bool | None = None) -> Path:
    """Write the checkpoint directory ``src`` as the single-file Lightning checkpoint ``dst``.

    ``dst`` holds the full ``state_dict`` and Lightning's loop, callback and hyperparameter state; it holds no optimizer
    or LR scheduler state (a single file identifies parameters by their position in one device's optimizer, which the
    directory does not record), like a ``save_weights_only`` checkpoint. ``weights_only`` is passed to ``torch.load``
    for the directory's ``trainer.pt`` (``False`` for checkpoints whose hyperparameters hold arbitrary objects; only
    for checkpoints you trust). The file appears complete or not at all.
    """
    src, dst = Path(src), Path(dst)
    if dst.exists() and dst.is_dir():
        raise IsADirectoryError(f"Destination {str(dst)!r} is a directory; give a file path such as 'model.ckpt'.")
    weights = load_model_weights(src, progress=progress)
    trainer_state = torch.load(src / fmt.TRAINER_STATE, map_location="cpu", weights_only=weights_only)
    if not isinstance(trainer_state, Mapping):
        raise PipelineCheckpointError(f"{str(src / fmt.TRAINER_STATE)!r} is not a Lightning checkpoint dict.")
    checkpoint = {**trainer_state, "state_dict": weights}
    # A resume would find no optimizer state: drop what would be restored without it.
    for key in ("optimizer_states", "lr_schedulers"):
        checkpoint.pop(key, None)
    tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid():x}")
    dst.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, tmp)
    os.replace(tmp, dst)
    return dst
