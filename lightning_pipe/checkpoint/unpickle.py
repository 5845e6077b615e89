"""Reading trusted pickles (``trainer.pt``, scheduler files): a class the file names that cannot be imported where it is
read is named, with the fix, instead of a bare ``ModuleNotFoundError`` from deep inside the unpickler."""

from __future__ import annotations

import pickle
import types
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.errors import PipelineCheckpointError


class _Unimportable(Exception):
    """A class a pickle names that cannot be imported here: its full name and the import's error."""


class _NamingUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError) as err:  # the module is not on sys.path, or no longer has the class
            raise _Unimportable(f"{module}.{name}", err) from err


def _naming_pickle_module() -> Any:
    """``pickle`` as ``torch.load(pickle_module=...)`` uses it, whose unpickler says which class it could not import."""
    naming = types.ModuleType("pickle")
    naming.Unpickler = _NamingUnpickler  # type: ignore[attr-defined]
    naming.load = lambda file, **kwargs: _NamingUnpickler(file, **kwargs).load()  # type: ignore[attr-defined]
    return naming


def load_pickled(file: Path, weights_only: bool | None) -> Any:
    """``torch.load(file)`` on the CPU; with ``weights_only=False``, a class that cannot be imported here is named, with
    the fix (the module holding it must be importable where the checkpoint is read)."""
    if weights_only is not False:
        return torch.load(file, map_location="cpu", weights_only=weights_only)
    try:
        return torch.load(file, map_location="cpu", weights_only=False, pickle_module=_naming_pickle_module())
    except _Unimportable as err:
        qualname, cause = err.args
        top = qualname.split(".")[0]
        raise PipelineCheckpointError(
            f"{str(file)!r} holds an object of class `{qualname}`, which cannot be imported here"
            f" ({type(cause).__name__}: {cause}). Unpickling a checkpoint imports the classes it holds (a network"
            f" kept by `save_hyperparameters()`): read it where `{qualname.rpartition('.')[0]}` is importable, from"
            f" the project's directory (the one holding `{top}`) or with that directory on PYTHONPATH"
            " (`PYTHONPATH=/path/to/project python -m lightning_pipe.checkpoint consolidate ...`)."
        ) from cause
