"""Conversion between lightning-pipe checkpoint directories and ordinary single-file Lightning checkpoints.

``consolidate``: a directory checkpoint (any pipeline layout) to one ``.ckpt`` that
``LightningModule.load_from_checkpoint`` and ``Trainer(strategy="auto")`` read; with ``with_optimizer``, also the
optimizer and LR scheduler states in torch's native single-device form, so ``Trainer(strategy="auto").fit(model,
ckpt_path=...)`` resumes the run. It runs in one process without a process group and holds the full model (and its
optimizer state) in CPU memory (and nothing else: entries are read in chunks).

The other direction needs no conversion step: ``PipelineParallelStrategy(init_weights=path)`` starts a pipeline run
from a ``.ckpt`` or a plain ``state_dict`` file, and ``trainer.fit(ckpt_path=...)`` resumes one from a single-device
``.ckpt``, each rank reading only its own stages.
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
from lightning_pipe.checkpoint import hparams, optim
from lightning_pipe.checkpoint.io import load_trainer_state
from lightning_pipe.checkpoint.unpickle import load_pickled
from lightning_pipe.compat import torch as torch_compat
from lightning_pipe.errors import PipelineCheckpointError
from lightning_pipe.reliability.loaders import LOADER_STATE

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
    if fmt.PARAM_GROUPS in manifest:  # names of every parameter: sizes are what a reader can check at a glance
        manifest[fmt.PARAM_GROUPS] = [[len(g) for g in groups] for groups in manifest[fmt.PARAM_GROUPS]]
    if fmt.NETWORK_RECORD in manifest:  # the whole config is for export-hf; the class says what it is
        manifest[fmt.NETWORK_RECORD] = {k: manifest[fmt.NETWORK_RECORD].get(k) for k in ("class", "attribute")}
    if fmt.HYPERPARAMETER_NETWORKS in manifest:  # every tensor's name is for consolidate; the count says enough
        manifest[fmt.HYPERPARAMETER_NETWORKS] = {k: len(v) for k, v in manifest[fmt.HYPERPARAMETER_NETWORKS].items()}
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
    info = inspect(path)
    weights = load_entries(path, fmt.MODEL_PREFIX, progress=progress, chunk_bytes=chunk_bytes)
    if len(weights) != info["model_entries"]:
        raise PipelineCheckpointError(f"Read {len(weights)} of {info['model_entries']} model entries from {path}.")
    # A tied parameter is stored once; a single-device state dict names it under every name, sharing one tensor.
    for name, first in info.get(fmt.ALIASES, {}).items():
        if first in weights:
            weights[name] = weights[first]
    return weights


def load_entries(path: Path, prefix: str, progress: bool = False, chunk_bytes: int = CHUNK_BYTES) -> dict[str, Any]:
    """Every DCP entry of the checkpoint directory ``path`` whose key starts with ``prefix``, keyed without it (CPU)."""
    import torch.distributed.checkpoint as dcp
    from tqdm import tqdm

    metadata = dcp.FileSystemReader(path).read_metadata()
    keys = [k for k in metadata.state_dict_metadata if k.startswith(prefix)]
    entries: dict[str, Any] = {}
    total = sum(size for _, size in _chunks(metadata, keys, chunk_bytes))
    desc = "consolidating" if prefix == fmt.MODEL_PREFIX else f"consolidating {prefix.rstrip('.')}"
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress, file=sys.stderr) as bar:
        for chunk, size in read_entries(path, keys, chunk_bytes, metadata):
            entries.update((key[len(prefix) :], value) for key, value in chunk.items())
            bar.update(size)
    return entries


def read_entries(
    path: Path, keys: list[str], chunk_bytes: int = CHUNK_BYTES, metadata: Any = None
) -> Iterator[tuple[dict[str, Any], int]]:
    """The DCP entries ``keys`` (full keys) of the checkpoint directory ``path`` on the CPU, in order, read about
    ``chunk_bytes`` at a time: yields ``({key: value}, bytes)`` per chunk (a larger tensor is a chunk of its own)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = metadata if metadata is not None else dcp.FileSystemReader(path).read_metadata()
    for chunk, size in _chunks(metadata, keys, chunk_bytes):
        state: dict[str, Any] = {}
        for key in chunk:
            meta = metadata.state_dict_metadata[key]
            if isinstance(meta, TensorStorageMetadata):
                state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
            else:
                state[key] = None  # DCP replaces a non-tensor entry by its stored value
        with warnings.catch_warnings():
            # "assuming the intent is to load in a single process": it is.
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        yield state, size


def load_optimizer_states(path: Path, progress: bool = False, weights_only: bool | None = None) -> dict[str, Any]:
    """The ``optimizer_states`` and ``lr_schedulers`` of a single-device Lightning checkpoint, from the checkpoint
    directory ``path``: parameters numbered in one device's order, recorded in the manifest when it was saved."""
    inspect(path)  # complete?
    manifest = fmt.read_manifest(path)
    if not manifest["optimizers"]:
        raise PipelineCheckpointError(
            f"{str(path)!r} holds no optimizer state (it was saved with weights only); consolidate it without"
            " `--with-optimizer`."
        )
    groups = manifest.get(fmt.PARAM_GROUPS)
    if groups is None or len(groups) != manifest["optimizers"]:
        raise PipelineCheckpointError(
            f"{str(path)!r} does not record its optimizers' parameter order on one device (saved by an earlier"
            " lightning-pipe, or by a run that could not record it; see docs/troubleshooting.md), so"
            " `--with-optimizer` cannot number its parameters. Resume it under the pipeline with"
            " `trainer.fit(ckpt_path=...)` in a new process and save it again, or consolidate without"
            " `--with-optimizer`."
        )
    states = []
    for i, optimizer_groups in enumerate(groups):
        flat = load_entries(path, f"optimizer_{i}.", progress=progress)
        states.append(optim.to_native(flat, optimizer_groups, i))
    files = manifest["lr_scheduler_files"]
    schedulers = [load_pickled(path / f, weights_only) for f in files]
    for name, other in zip(files[1:], schedulers[1:]):
        if not fmt.same_state(schedulers[0], other):
            raise PipelineCheckpointError(
                f"The LR scheduler states of {str(path)!r} differ between pipeline ranks ({files[0]} vs {name}), so"
                " no single-device scheduler state can be built. Consolidate without `--with-optimizer`, or give"
                " every rank's `configure_optimizers` the same param groups."
            )
    return {"optimizer_states": states, "lr_schedulers": schedulers[0] if schedulers else []}


def _drop_stand_in_loader_states(checkpoint: dict[str, Any]) -> None:
    """Remove the training loaders' states that the strategy's stand-in loaders (``ResumableLoader``) wrote: plain
    Lightning's ``DataLoader`` has none, and Lightning refuses to resume a run whose count of loader states differs
    from its loaders' ("The CombinedLoader has 0 stateful loaders, but found 1 states"). A loader's own state (a
    torchdata ``StatefulDataLoader``) stays."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    states = loop.get("combined_loader")
    if isinstance(states, list):
        loop["combined_loader"] = [s for s in states if s != LOADER_STATE]


def consolidate(
    src: Path, dst: Path, progress: bool = False, weights_only: bool | None = None, with_optimizer: bool = False
) -> Path:
    """Write the checkpoint directory ``src`` as the single-file Lightning checkpoint ``dst``.

    ``dst`` holds the full ``state_dict`` and Lightning's loop, callback and hyperparameter state (a network kept by
    ``save_hyperparameters()`` whole, holding these weights). With
    ``with_optimizer``, it also holds the optimizer states (torch's native form: parameters numbered in the order
    ``configure_optimizers`` gives them on one device) and LR scheduler states, so ``Trainer(strategy="auto")``
    resumes the run from it; without, it holds neither, like a ``save_weights_only`` checkpoint. ``weights_only`` is
    passed to ``torch.load`` for the directory's ``trainer.pt`` and scheduler files (``False`` for checkpoints whose
    hyperparameters hold arbitrary objects; only for checkpoints you trust). The file appears complete or not at all.
    """
    src, dst = Path(src), Path(dst)
    if dst.exists() and dst.is_dir():
        raise IsADirectoryError(f"Destination {str(dst)!r} is a directory; give a file path such as 'model.ckpt'.")
    optimizer_state = load_optimizer_states(src, progress, weights_only) if with_optimizer else {}
    weights = load_model_weights(src, progress=progress)
    fix = "add `--trust-pickle` to the command (`weights_only=False` in Python)"
    trainer_state = load_trainer_state(src, weights_only, fix)
    if not isinstance(trainer_state, Mapping):
        raise PipelineCheckpointError(f"{str(src / fmt.TRAINER_STATE)!r} is not a Lightning checkpoint dict.")
    checkpoint = {**trainer_state, "state_dict": weights, **optimizer_state}
    networks = fmt.read_manifest(src).get(fmt.HYPERPARAMETER_NETWORKS)
    if networks and isinstance(checkpoint.get("hyper_parameters"), dict):
        checkpoint["hyper_parameters"] = dict(checkpoint["hyper_parameters"])
        hparams.fill(checkpoint["hyper_parameters"], weights, networks)
    _drop_stand_in_loader_states(checkpoint)
    if not with_optimizer:
        # A resume would find no optimizer state: drop what would be restored without it.
        for key in ("optimizer_states", "lr_schedulers"):
            checkpoint.pop(key, None)
    tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid():x}")
    dst.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, tmp)
    os.replace(tmp, dst)
    return dst
