"""Walking the nested values a step handles (batches, network calls, outputs): dicts, lists, tuples, namedtuples.

Pure helpers shared by every layer; they know nothing of pipelines.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Callable

import torch

#: The attribute that marks a namedtuple (documented public API despite its underscore).
NAMEDTUPLE_FIELDS = "_fields"


def is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, NAMEDTUPLE_FIELDS)


def map_structure(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Rebuild ``obj`` (dicts, lists, tuples, namedtuples, nested) with every other leaf replaced by ``fn(leaf)``."""
    if isinstance(obj, Mapping):
        items = {k: map_structure(v, fn) for k, v in obj.items()}
        return items if type(obj) is dict else type(obj)(items)
    if is_namedtuple(obj):
        return type(obj)(*(map_structure(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_structure(v, fn) for v in obj)
    return fn(obj)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it; other leaves are kept."""
    return map_structure(obj, lambda leaf: fn(leaf) if isinstance(leaf, torch.Tensor) else leaf)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj``, through lists, tuples and mappings (a Hugging Face ``ModelOutput`` is one)."""
    # Lists and tuples tested before Mapping: an ABC isinstance check is several times slower (runs every step).
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    if type(obj) is dict or isinstance(obj, Mapping):  # (a plain dict, a network call's keywords, without the ABC)
        return [t for v in obj.values() for t in tensors_in(v)] if obj else []
    return []


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor (a tensor split over processes: FSDP and tensor-parallel parameters, their
    gradients and activations), without importing ``torch.distributed.tensor``: none exists before it was imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)
