"""A model kind's files (torchtitan's ``ModelSpec.state_dict_adapter``): the :class:`StateDictAdapter` protocol.

A kind whose family has its own on-disk format (a transformers ``save_pretrained`` directory, a peft adapter
directory, a format of the user's own) gives an adapter that

- recognises one of its directories (:meth:`StateDictAdapter.reads`), for ``init_weights=DIR``;
- plans which stored tensors fill one rank's own tensors (:meth:`StateDictAdapter.plan_load`, a :class:`LoadPlan`)
  and copies them (:meth:`StateDictAdapter.copy_into`), each rank reading only its stages' tensors;
- optionally plans a rank's adapter tensors from an adapter directory (:meth:`StateDictAdapter.plan_adapters`, for
  ``init_adapter=DIR``);
- writes a checkpoint back in the family's format (:meth:`StateDictAdapter.export`) from the checkpoint's entries
  (:class:`CheckpointEntries`) and what the kind's ``record`` kept.

Everything here is local to one process: the checkpoint code runs it on every rank, agrees on the errors and writes
exports atomically; it finds an adapter by directory (:func:`lightning_pipe.models.files_reading`) or by the name a
checkpoint's record gives (:func:`lightning_pipe.models.files_named`). Pure: no process group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from lightning_pipe.errors import PipelineCheckpointError

#: transformers' default shard size in 4.x (``save_pretrained(max_shard_size="5GB")``)
DEFAULT_SHARD_SIZE = "5GB"
#: the dtypes an export converts floating-point tensors to, by name (``--dtype``)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


#: The record entry naming the adapter that exports a checkpoint (absent: the transformers adapter, as recorded by
#: lightning-pipe before adapters had names).
FORMAT = "format"


@dataclass(frozen=True)
class LoadPlan:
    """What one rank reads from a directory, and what it could not find there."""

    #: the adapter's own index of the directory (its :meth:`StateDictAdapter.copy_into` and messages read it)
    directory: Any
    #: stored name -> this rank's tensors it fills (several for parameters tied on this rank, one storage each)
    targets: dict[str, list[torch.Tensor]]
    #: this rank's state-dict keys found under no name (those the family ignores left out)
    missing: list[str] = dataclasses.field(default_factory=list)
    #: stored names not read but not unexpected (another name of a tied parameter, what the family ignores)
    ignorable: set[str] = dataclasses.field(default_factory=set)
    #: this rank's state-dict keys of a task head the directory does not hold: they keep their initialisation
    new_head: list[str] = dataclasses.field(default_factory=list)
    #: every name the directory stores (``None``: the keys of ``directory.files``)
    stored: frozenset[str] | None = None
    #: what is read, for messages (a file or the directory)
    where: str = ""

    @property
    def stored_names(self) -> frozenset[str]:
        return self.stored if self.stored is not None else frozenset(self.directory.files)


@dataclass(frozen=True)
class LoadTarget:
    """This rank's side of a load from a directory (built by the checkpoint code)."""

    #: this rank's stages' state dict, under the LightningModule's names
    state: Mapping[str, Any]
    #: the pipelined network (the LightningModule's ``network_prefix`` attribute)
    network: nn.Module
    #: its :class:`~lightning_pipe.models.base.ModelKind` (its names on disk, what its loader ignores)
    kind: Any
    #: the network's attribute as a name prefix (``"model."``; ``""`` for the module itself)
    network_prefix: str
    #: the names of each tied parameter (in the module, or across stages), the first the one stored
    groups: Sequence[Sequence[str]] = ()


#: ``assign(target, whole)``: copy a stored tensor (whole) into one of this rank's tensors (a DTensor takes its part)
Assign = Callable[[torch.Tensor, torch.Tensor], None]


def copy_whole(target: torch.Tensor, whole: torch.Tensor) -> None:
    """The :data:`Assign` of plain tensors."""
    with torch.no_grad():
        target.copy_(whole)


@dataclass(frozen=True)
class CheckpointEntries:
    """A lightning-pipe checkpoint's model entries, as an export reads them (built by the checkpoint code)."""

    #: the checkpoint directory (for messages)
    path: Path
    #: what the network's kind recorded when it was saved (``ModelKind.record``; ``None``: nothing)
    record: Mapping[str, Any] | None
    #: the checkpoint in a few words, for messages
    description: str
    #: tensor entries under the LightningModule's names: ``(shape, dtype)``
    stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    #: every model entry's name (non-tensor entries too)
    names: frozenset[str]
    #: ``{name: first name}`` of tied parameters stored once
    aliases: Mapping[str, str]
    #: ``read(names, chunk_bytes)``: the entries ``names`` in order, about ``chunk_bytes`` at a time
    read: Callable[[Sequence[str], int], Iterator[dict[str, Any]]]


@dataclass(frozen=True)
class ExportOptions:
    """What ``export-hf`` was asked for (an adapter uses the options its format has)."""

    #: the LightningModule's attribute holding the network (``None``: recorded, or found from the names)
    attribute: str | None = None
    #: a directory whose configuration to write instead of the recorded one (transformers: ``config.json``)
    config: Path | None = None
    #: the largest file written, in bytes or as ``"5GB"``
    max_shard_size: int | str = DEFAULT_SHARD_SIZE
    #: floating-point tensors written in this dtype (``None``: as stored)
    dtype: torch.dtype | None = None
    #: show a progress bar
    progress: bool = False
    #: a PEFT model: write its adapters only
    adapter: bool = False
    #: a PEFT model: write it with its adapters merged in
    merge: bool = False


class StateDictAdapter(Protocol):
    """A model family's files (see the module docstring)."""

    #: the adapter's name, recorded under :data:`FORMAT` by the kind's ``record``
    name: str
    #: what one of its directories is called in messages ("Hugging Face model directory")
    title: str

    def reads(self, path: Path) -> bool:
        """Whether ``path`` is one of the family's directories (a lightning-pipe checkpoint is never asked)."""
        ...

    def plan_load(self, path: Path, target: LoadTarget) -> LoadPlan:
        """Match this rank's tensors (``target``) to those stored in ``path``."""
        ...

    def copy_into(self, plan: LoadPlan, assign: Assign = copy_whole) -> int:
        """Read the planned tensors into their targets; returns the bytes read."""
        ...

    def plan_adapters(self, path: Path, network: nn.Module) -> list[LoadPlan] | None:
        """One plan per adapter of ``network`` from the adapter directory ``path``; ``None``: the kind has no
        adapters."""
        ...

    def mismatch_message(self, path: Path, missing: Sequence[str], unexpected: Sequence[str], strict: bool) -> str:
        """The error (``strict``) or warning for keys that the model and the directory ``path`` do not share."""
        ...

    def new_head_message(self, path: Path, network: nn.Module, plan: LoadPlan, keys: Sequence[str]) -> str:
        """The warning for task-head keys ``keys`` that the directory ``path`` (another class's) does not hold."""
        ...

    def export(self, entries: CheckpointEntries, out: Path, options: ExportOptions) -> None:
        """Write the checkpoint ``entries`` into the empty directory ``out`` in the family's format."""
        ...


def dtype_of(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``dtype`` as a torch dtype: one of :data:`DTYPES` by name, or ``None`` (as trained)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise PipelineCheckpointError(f"`dtype={dtype!r}` is not one of {sorted(DTYPES)} (or None: as trained).")
    return DTYPES[dtype]


def format_keys(keys: Iterable[str], limit: int = 6) -> str:
    """``'a', 'b', 'c' and 12 more``: long key lists stay readable in an error message."""
    keys = sorted(keys)
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def load_mapped(file: Path, weights_only: bool | None = True) -> Any:
    """``torch.load`` of ``file`` memory-mapped: a tensor is read when touched. A file in torch's legacy (non-zip)
    format cannot be mapped and is read whole."""
    try:
        return torch.load(file, map_location="cpu", mmap=True, weights_only=weights_only)
    except RuntimeError as err:
        if "mmap" not in str(err):
            raise
        return torch.load(file, map_location="cpu", weights_only=weights_only)
