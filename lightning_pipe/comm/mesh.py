"""The process topology: a ``DeviceMesh`` with a data-parallel axis ``"dp"`` and a pipeline axis ``"pp"``.

The strategy builds the mesh once per default process group (``init_device_mesh``) and hands it to whoever needs
it: the pipeline (``"pp"`` group), gradient synchronisation and metrics (``"dp"`` group), checkpoints, and the user's
``configure_model`` as ``self.device_mesh``. The placement of ranks on the mesh is a pure function, tested without a
process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_pipe.settings import DP, PP, InnerAxis, PipelineSettings, check_inner_axis

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class MeshLayout:
    """How ``world_size`` processes form ``data_parallel_size`` pipelines of ``pipeline_size`` processes.

    ``inner="dp"`` (default): the replicas of one stage position are consecutive (``rank = pp_rank *
    data_parallel_size + dp_rank``), so data-parallel traffic (every gradient; FSDP's gathers) stays inside a node and
    pipelines span nodes ("pp outermost", as torchtitan lays out its mesh); ``inner="pp"``: the ranks of one pipeline
    are consecutive (``rank = dp_rank * pipeline_size + pp_rank``). See docs/data-parallel.md for the argument.
    """

    pipeline_size: int
    data_parallel_size: int
    inner: InnerAxis = DP

    def __post_init__(self) -> None:
        check_inner_axis(self.inner)

    @property
    def world_size(self) -> int:
        return self.pipeline_size * self.data_parallel_size

    @property
    def shape(self) -> tuple[int, int]:
        """The mesh shape, outer axis first."""
        return (
            (self.data_parallel_size, self.pipeline_size)
            if self.inner == PP
            else (self.pipeline_size, self.data_parallel_size)
        )

    @property
    def axis_names(self) -> tuple[str, str]:
        return (DP, PP) if self.inner == PP else (PP, DP)

    def coordinates(self, rank: int) -> tuple[int, int]:
        """``(dp_rank, pp_rank)`` of global ``rank``."""
        outer, inner = divmod(rank, self.shape[1])
        return (outer, inner) if self.inner == PP else (inner, outer)

    def rank(self, dp_rank: int, pp_rank: int) -> int:
        if self.inner == PP:
            return dp_rank * self.pipeline_size + pp_rank
        return pp_rank * self.data_parallel_size + dp_rank

    def pipeline_ranks(self, dp_rank: int) -> list[int]:
        """Global ranks of pipeline ``dp_rank``, by pipeline rank."""
        return [self.rank(dp_rank, p) for p in range(self.pipeline_size)]

    def replica_ranks(self, pp_rank: int) -> list[int]:
        """Global ranks holding pipeline position ``pp_rank``, by data-parallel rank."""
        return [self.rank(d, pp_rank) for d in range(self.data_parallel_size)]


def build_mesh(layout: MeshLayout, device_type: str) -> DeviceMesh:
    """The ``DeviceMesh`` of ``layout`` over the default process group (collective: every rank calls it)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, layout.shape, mesh_dim_names=layout.axis_names)


def axis_group(mesh: DeviceMesh, axis: str) -> Any:
    """This rank's process group along ``axis``."""
    return mesh.get_group(axis)


def axis_rank(mesh: DeviceMesh, axis: str) -> int:
    return mesh.get_local_rank(axis)


class MeshCache:
    """The run's mesh, built once per default process group: later Trainer entries (fit -> validate -> test) reuse
    its groups, and a new process group (a new run in the same process) gets a new mesh."""

    def __init__(self) -> None:
        self.layout = MeshLayout(1, 1)
        self._mesh: DeviceMesh | None = None
        self._world: Any = None

    def build(self, settings: PipelineSettings, device_type: str) -> DeviceMesh:
        """The mesh of resolved ``settings`` (collective: every rank calls it)."""
        from lightning_pipe.comm import collectives

        self.layout = MeshLayout(int(settings.pipeline_size), settings.data_parallel_size, settings.inner_axis)  # type: ignore[arg-type]
        world = collectives.world_group()
        built = None if self._mesh is None else (tuple(self._mesh.shape), tuple(self._mesh.mesh_dim_names or ()))
        if self._world is not world or built != (self.layout.shape, self.layout.axis_names):
            self._mesh, self._world = build_mesh(self.layout, device_type), world
        return self._mesh
