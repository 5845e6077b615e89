"""Point-to-point transfer of nested objects of tensors between pipeline ranks, shapes unknown to the receiver.

The forward-only evaluation pass sends stage activations (whose shapes change with every short batch) and predictions
without torch's shape inference: each object goes as a pickled skeleton (structure, non-tensor leaves, tensor shapes
and dtypes) followed by its tensors, which never pass through pickle. A DTensor (a tensor-parallel activation) goes as
its local part with its layout in the skeleton, and is rebuilt on the receiver's mesh.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pipe.comm import collectives
from lightning_pipe.comm.dtensor import Layout, MeshLookup, is_dtensor
from lightning_pipe.errors import PipelineUsageError
from lightning_pipe.structures import map_structure


@dataclass(frozen=True)
class _Slot:
    """Where a tensor sat in a packed object."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    #: a DTensor's layout (``shape`` is then its local part's), ``None`` for a plain tensor
    layout: Layout | None = None


def pack(obj: Any, detach: bool = True) -> tuple[Any, list[torch.Tensor]]:
    """Split ``obj`` into a picklable skeleton (tensors replaced by slots) and its tensors in slot order (detached
    unless ``detach=False``: a last stage's output keeps its autograd graph for the loss)."""
    tensors: list[torch.Tensor] = []

    def to_slot(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if is_dtensor(leaf) and detach:
            layout, part = Layout.of(leaf), leaf.to_local().detach().contiguous()  # type: ignore[attr-defined]
            tensors.append(part)
            return _Slot(len(tensors) - 1, tuple(part.shape), part.dtype, layout)
        tensors.append(leaf.detach().contiguous() if detach else leaf)
        return _Slot(len(tensors) - 1, tuple(leaf.shape), leaf.dtype)

    return map_structure(obj, to_slot), tensors


def unpack(skeleton: Any, tensors: list[torch.Tensor], mesh_of: MeshLookup | None = None) -> Any:
    """Inverse of :func:`pack`; ``mesh_of`` gives the mesh on which a sent DTensor is rebuilt."""

    def from_slot(leaf: Any) -> Any:
        if not isinstance(leaf, _Slot):
            return leaf
        if leaf.layout is None:
            return tensors[leaf.index]
        assert mesh_of is not None, "the receiver of a DTensor knows the mesh to rebuild it on"
        return leaf.layout.rebuild(tensors[leaf.index], mesh_of)

    return map_structure(skeleton, from_slot)


def slots(skeleton: Any) -> list[_Slot]:
    """The tensor slots of a skeleton, in index order."""
    found: list[_Slot] = []
    map_structure(skeleton, lambda leaf: found.append(leaf) if isinstance(leaf, _Slot) else None)
    return sorted(found, key=lambda s: s.index)


def send_object(obj: Any, dst: int, group: Any, device: torch.device) -> list[Any]:
    """Post non-blocking sends of ``obj`` to global rank ``dst``.

    Returns the pending works; the caller keeps them (they hold the buffers) and waits on them once the pass ends, so
    sends never block the sender's next stage.
    """
    skeleton, tensors = pack(obj)
    try:
        header = pickle.dumps(skeleton)
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise PipelineUsageError(
            f"A stage output or prediction of type {type(obj).__name__} cannot be sent to the next pipeline rank"
            f" ({err}). Stage outputs and predictions must be tensors or lists/tuples/dicts of tensors and plain"
            " values."
        ) from err
    payload = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    return [collectives.isend(t, dst, group) for t in (length, payload, *tensors)]


def recv_object(src: int, group: Any, device: torch.device, mesh_of: MeshLookup | None = None) -> Any:
    """Receive one object sent by :func:`send_object` from global rank ``src`` (DTensors rebuilt on ``mesh_of``)."""
    length = torch.empty(1, dtype=torch.int64, device=device)
    collectives.recv_(length, src, group)
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    collectives.recv_(payload, src, group)
    skeleton = pickle.loads(payload.cpu().numpy().tobytes())
    tensors = []
    for slot in slots(skeleton):
        t = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        collectives.recv_(t, src, group)
        tensors.append(t)
    return unpack(skeleton, tensors, mesh_of)


def wait_all(works: list[Any]) -> None:
    collectives.wait(works)
