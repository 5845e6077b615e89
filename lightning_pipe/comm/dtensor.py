"""DTensors (tensor-parallel and FSDP parameters, sharded activations) as the rest of lightning-pipe handles them:
this rank's part, the whole tensor, a whole tensor placed like a DTensor, and a DTensor's description for sending it.

``torch.distributed.tensor`` is imported only where a DTensor can exist: none exists before it was imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from lightning_pipe.structures import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Layout", "MeshLookup", "assign_whole_", "axis_names", "full", "is_dtensor", "local", "place_like"]

#: ``mesh_of(axis names) -> DeviceMesh``: the strategy's (sub)mesh with these axes
MeshLookup = Callable[[tuple[str, ...]], "DeviceMesh"]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard, ``t`` itself otherwise."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def full(t: Any) -> Any:
    """``t`` whole: a DTensor gathered (collective over its mesh: every rank holding a part calls it alike), any other
    value as it is."""
    return t.full_tensor() if is_dtensor(t) else t


def axis_names(t: torch.Tensor) -> tuple[str, ...]:
    """The mesh axes a DTensor lives on (``()`` for a plain tensor)."""
    return tuple(t.device_mesh.mesh_dim_names or ()) if is_dtensor(t) else ()  # type: ignore[attr-defined]


def sharded_axes(t: torch.Tensor) -> set[str]:
    """The mesh axes over which ``t`` is split (a plain tensor: none; it is whole wherever it is held)."""
    if not is_dtensor(t):
        return set()
    return {name for name, p in zip(axis_names(t), t.placements) if not p.is_replicate()}  # type: ignore[attr-defined]


def place_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``whole`` (the full tensor, the same on every rank) laid out as ``like``: for a DTensor ``like``, a DTensor of
    the same mesh and placements holding this rank's slice of ``whole`` (cut locally, no communication); else
    ``whole`` itself. The device follows ``like``, the dtype stays ``whole``'s."""
    whole = whole.to(device=local(like).device)
    if not is_dtensor(like):
        return whole
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)  # type: ignore[attr-defined]


def assign_whole_(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy ``whole`` (the full tensor) into ``target``, a plain tensor or this rank's part of a DTensor."""
    with torch.no_grad():
        local(target).copy_(local(place_like(whole, target)))


@dataclass(frozen=True)
class Layout:
    """How a DTensor is laid out, picklable: its mesh axes, placements, global shape and stride."""

    axes: tuple[str, ...]
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @staticmethod
    def of(t: torch.Tensor) -> Layout:
        return Layout(axis_names(t), tuple(t.placements), tuple(t.shape), tuple(t.stride()))  # type: ignore[attr-defined]

    def rebuild(self, part: torch.Tensor, mesh_of: MeshLookup) -> torch.Tensor:
        """The DTensor whose local part is ``part``."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            part, mesh_of(self.axes), self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


def submesh_lookup(mesh: DeviceMesh) -> MeshLookup:
    """``mesh_of`` for the strategy's ``mesh``: its submesh of the named axes."""

    def mesh_of(names: Sequence[str]) -> DeviceMesh:
        names = tuple(names)
        return mesh[names[0]] if len(names) == 1 else mesh[names]

    return mesh_of
