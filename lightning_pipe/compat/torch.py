"""Private torch names used by lightning-pipe, one function each (checked with torch 2.13).

Replace each with the public API named in its docstring once torch offers it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn


# ---------------------------------------------------------------------------------------------------- nn.Module
def children(module: nn.Module) -> dict[str, nn.Module | None]:
    """The module's child slots, ``None`` entries included (``module._modules``).

    Public ``named_children()`` skips ``None`` children and cannot be assigned to; stage surgery needs both.
    """
    return module._modules


def set_children(module: nn.Module, slots: Mapping[str, nn.Module | None]) -> None:
    """Replace the module's child slots wholesale, keeping their keys (``module._modules = ...``).

    ``del module_list[i]`` (public) renumbers the entries after ``i``; a stage must keep the full model's keys
    (``layers.5`` stays ``layers.5``), and a shallow-copied stage view must not share the slot dict of the network.
    """
    module.__dict__["_modules"] = dict(slots)


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """Parameters registered directly on ``module`` (``module._parameters``); public ``named_parameters(recurse=False)``
    would do for reading but not for re-registering the same objects under the same names on another module."""
    return module._parameters


def own_buffers(module: nn.Module) -> dict[str, Any]:
    """Buffers registered directly on ``module`` (``module._buffers``), read like :func:`own_parameters`."""
    return module._buffers


def mark_non_persistent(module: nn.Module, name: str) -> None:
    """Keep buffer ``name`` out of the state dict (``module._non_persistent_buffers_set``).

    Public: ``register_buffer(name, tensor, persistent=False)``, which would re-register the tensor; used when a merged
    module must mirror the original network's state-dict keys exactly.
    """
    module._non_persistent_buffers_set.add(name)


# ---------------------------------------------------------------------------------------------------- checkpoint
def flatten_state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """Flat ``"a.b.c"`` keys of a nested state dict, as torch.distributed.checkpoint stores them
    (``torch.distributed.checkpoint._nested_dict.flatten_state_dict``; no public equivalent in torch 2.13)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    flat, _ = flatten(dict(state))
    return flat


def storage_extents(metadata: Any) -> list[tuple[str, int]]:
    """``(file relative to the checkpoint, end offset)`` of every item a DCP checkpoint stores.

    ``Metadata.storage_data`` maps items to the private ``_StorageInfo(relative_path, offset, length)`` of the
    filesystem writer; torch 2.13 has no public reader of it. Used to detect truncated shards before loading.
    """
    return [(info.relative_path, info.offset + info.length) for info in (metadata.storage_data or {}).values()]


# ---------------------------------------------------------------------------------------------------- memory
def dispatch_mode_class() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``: sees every operator call, which is how CPU tensor bytes are
    counted (torch 2.13 has no CPU allocator statistic; ``torch.cuda.max_memory_allocated`` serves CUDA). Private
    module, but the mode is the documented ``__torch_dispatch__`` extension point."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


# ---------------------------------------------------------------------------------------------------- operators
# A dispatch mode sees ATen operators; what they read and write is in their schema (`OpOverload._schema`, private;
# torch 2.13 has no public schema accessor).
_UNINITIALISED = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})


def op_name(func: Any) -> str:
    """The operator's name without namespace and overload (``aten::normal_`` -> ``normal_``)."""
    return func._schema.name.split("::")[-1]


def reads_values(func: Any) -> bool:
    """Whether the operator reads its tensor inputs' values; ``*_like`` and ``new_*`` factories read only their shape,
    dtype and device."""
    name = op_name(func)
    return not (name.endswith("_like") or name.startswith("new_") or name in _UNINITIALISED)


def fills_nothing(func: Any) -> bool:
    """Whether the operator allocates without setting values (``empty``, ``new_empty``, ...)."""
    return op_name(func) in _UNINITIALISED


def returns_view(func: Any) -> bool:
    """Whether the operator returns a view of an input (``view``, ``t``, ``slice``, ...), not new values."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The tensors the operator writes in place: ``self`` of ``normal_``, ``out=`` arguments, ...
    (arguments whose schema alias annotation is a write, ``Tensor(a!)``)."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            written += tensors_of(value)
    return written


def tensors_of(value: Any) -> list[Any]:
    """The tensors in a nested structure of operator arguments or outputs (``torch.utils._pytree``)."""
    import torch
    from torch.utils._pytree import tree_leaves

    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]
