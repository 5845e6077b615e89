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


# ---------------------------------------------------------------------------------------------------- fake tensors
def fake_tensor_mode() -> Any:
    """A ``torch._subclasses.fake_tensor.FakeTensorMode`` that accepts real tensors as inputs.

    Fake tensors have shapes, dtypes and devices but no data: the dataflow frontend runs the units other stages hold
    on them (what a unit returns, not what it computes), and real tensors that meet one in an operation give a fake
    result. torch 2.13 has no public fake-tensor API (``torch.export`` uses this mode internally).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(value: Any) -> bool:
    """Whether ``value`` is a fake tensor (``torch._subclasses.fake_tensor.FakeTensor``)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """What a fake tensor raises when code needs its values or a shape that depends on them (``.item()``, ``if
    t.any()``, ``nonzero``), or meets an operator without a shape function: ``torch._subclasses.fake_tensor``'s
    ``DataDependentOutputException``, ``DynamicOutputShapeException`` and ``UnsupportedOperatorException``."""
    from torch._subclasses import fake_tensor

    return (
        fake_tensor.DataDependentOutputException,
        fake_tensor.DynamicOutputShapeException,
        fake_tensor.UnsupportedOperatorException,
    )


def version(tensor: Any) -> int:
    """The tensor's version counter (``tensor._version``), which every in-place operation increments; torch 2.13
    has no public reader. Tells whether code changed a value in place after it was recorded."""
    return tensor._version
