"""Export a lightning-pipe checkpoint directory in its model family's format: ``python -m lightning_pipe.checkpoint
export-hf CKPT_DIR OUT_DIR``.

The checkpoint's network record (what the network's kind recorded when it was saved, ``ModelKind.record``) names the
kind's files (:data:`lightning_pipe.models.files.FORMAT`; a record without it, or none, is a transformers network's):
this module reads the checkpoint's model entries for them (:class:`~lightning_pipe.models.files.CheckpointEntries`)
and lets the kind's :meth:`~lightning_pipe.models.files.StateDictAdapter.export` write into a temporary sibling of
the output, renamed into place when complete: the directory appears complete or not at all. A transformers network
is written as ``save_pretrained`` writes it (:mod:`lightning_pipe.models.huggingface.export`), a PEFT model's
adapters as peft does (:mod:`lightning_pipe.models.peft_io`).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.checkpoint import convert
from lightning_pipe.checkpoint import format as fmt
from lightning_pipe.checkpoint.save import replace_directory
from lightning_pipe.errors import PipelineCheckpointError
from lightning_pipe.models import files_named
from lightning_pipe.models.files import DEFAULT_SHARD_SIZE, FORMAT, CheckpointEntries, ExportOptions, dtype_of

#: the format of a record that names none (lightning-pipe recorded transformers networks only before formats had names)
DEFAULT_FORMAT = "transformers"


def export(
    src: Path,
    dst: Path,
    *,
    config: Path | None = None,
    attribute: str | None = None,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    dtype: str | torch.dtype | None = None,
    progress: bool = False,
    overwrite: bool = False,
    adapter: bool = False,
    merge: bool = False,
) -> Path:
    """Write the checkpoint directory ``src`` as the model directory ``dst`` of its kind's format (see the module
    docstring).

    ``config``: a Hugging Face directory whose ``config.json`` (and ``generation_config.json``) to use instead of
    the config recorded in the checkpoint; ``attribute``: the LightningModule's attribute holding the network
    (recorded, or found from the names); ``dtype``: ``"bfloat16"``, ``"float16"`` or ``"float32"`` to convert
    floating-point weights to (default: as trained); ``overwrite``: replace an existing ``dst``. A checkpoint of a
    PEFT model is exported with ``adapter=True`` (its adapters, for ``PeftModel.from_pretrained``) or ``merge=True``
    (the model with its adapters merged in): :mod:`lightning_pipe.models.peft_io`.
    """
    src, dst = Path(src), Path(dst)
    options = ExportOptions(
        attribute=attribute,
        config=config,
        max_shard_size=max_shard_size,
        dtype=dtype_of(dtype),
        progress=progress,
        adapter=adapter,
        merge=merge,
    )
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        raise PipelineCheckpointError(
            f"{str(dst)!r} exists. Export to a new directory, or pass `--overwrite` (`overwrite=True`) to replace it."
        )
    convert.inspect(src)  # complete?
    entries = checkpoint_entries(src)
    name = (entries.record or {}).get(FORMAT, DEFAULT_FORMAT)
    files = files_named(name)
    if files is None:
        raise PipelineCheckpointError(
            f"{str(src)!r} records a network whose files are of the format {name!r}, which no model kind exports."
            " Register the kind that saved it (`lightning_pipe.models.register_kind(claim, files=...)`) before"
            " exporting."
        )
    return write_directory(dst, lambda out: files.export(entries, out, options))


def write_directory(dst: Path, fill: Callable[[Path], None]) -> Path:
    """Let ``fill`` write an empty temporary sibling of ``dst``, then rename it to ``dst`` (replacing one that
    exists): ``dst`` appears complete or not at all."""
    token = uuid.uuid4().hex[:12]
    tmp = fmt.temporary_path(dst, token)
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.mkdir()
        fill(tmp)
        replace_directory(tmp, dst, token)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def checkpoint_entries(src: Path) -> CheckpointEntries:
    """The model entries of the checkpoint directory ``src`` (under the LightningModule's names), its network record
    and aliases, read on demand."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    info = fmt.read_manifest(src)
    metadata = dcp.FileSystemReader(src).read_metadata()
    model = {
        key[len(fmt.MODEL_PREFIX) :]: meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(fmt.MODEL_PREFIX)
    }
    stored = {
        name: (tuple(meta.size), meta.properties.dtype)
        for name, meta in model.items()
        if isinstance(meta, TensorStorageMetadata)
    }

    def read(names: Sequence[str], chunk_bytes: int) -> Iterator[dict[str, Any]]:
        keys = [fmt.MODEL_PREFIX + name for name in names]
        for chunk, _ in convert.read_entries(src, keys, chunk_bytes, metadata):
            # popped: a tensor is dropped once the adapter has written it
            yield {key[len(fmt.MODEL_PREFIX) :]: chunk.pop(key) for key in list(chunk)}

    return CheckpointEntries(
        path=src,
        record=info.get(fmt.NETWORK_RECORD),
        description=fmt.describe(info),
        stored=stored,
        names=frozenset(model),
        aliases=info.get(fmt.ALIASES, {}),
        read=read,
    )
