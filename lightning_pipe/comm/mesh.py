"""The process topology: a ``DeviceMesh`` with a pipeline axis ``"pp"``, a data-parallel axis ``"dp"`` and a
tensor-parallel axis ``"tp"`` (size 1 without tensor parallelism).

The strategy builds the mesh once per default process group (``init_device_mesh``) and hands it to whoever needs
it: the pipeline (``"pp"`` group: the same tensor-parallel rank of every stage, as torchtitan takes its pipeline groups
from its mesh), gradient synchronisation and metrics (``"dp"`` group), tensor parallelism (``"tp"``), checkpoints, and
the user's ``configure_model`` as ``self.device_mesh``. The placement of ranks on the mesh is a pure function, tested
without a process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_pipe.errors import PipelineUsageError
from lightning_pipe.settings import DP, PP, TP, InnerAxis, PipelineSettings, check_inner_axis

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class MeshLayout:
    """How ``world_size`` processes form ``data_parallel_size`` pipelines of ``pipeline_size`` stage positions, each
    position held by ``tensor_parallel_size`` processes.

    ``"tp"`` is always the innermost axis: the processes sharing a stage are consecutive (one node, the fastest links),
    because tensor parallelism communicates inside every layer, forward and backward. Of the other two,
    ``inner="dp"`` (default) makes the replicas of one stage position consecutive (``rank = (pp_rank *
    data_parallel_size + dp_rank) * tensor_parallel_size + tp_rank``), so data-parallel traffic (every gradient; FSDP's
    gathers) stays inside a node and pipelines span nodes ("pp outermost", as torchtitan lays out its mesh);
    ``inner="pp"``: the ranks of one pipeline are consecutive (``rank = (dp_rank * pipeline_size + pp_rank) *
    tensor_parallel_size + tp_rank``). See docs/data-parallel.md and docs/tensor-parallel.md.
    """

    pipeline_size: int
    data_parallel_size: int
    inner: InnerAxis = DP
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        check_inner_axis(self.inner)

    @property
    def world_size(self) -> int:
        return self.pipeline_size * self.data_parallel_size * self.tensor_parallel_size

    @property
    def shape(self) -> tuple[int, int, int]:
        """The mesh shape, outer axis first."""
        if self.inner == PP:
            return (self.data_parallel_size, self.pipeline_size, self.tensor_parallel_size)
        return (self.pipeline_size, self.data_parallel_size, self.tensor_parallel_size)

    @property
    def axis_names(self) -> tuple[str, str, str]:
        return (DP, PP, TP) if self.inner == PP else (PP, DP, TP)

    def coordinates(self, rank: int) -> tuple[int, int]:
        """``(dp_rank, pp_rank)`` of global ``rank``."""
        outer, inner = divmod(rank // self.tensor_parallel_size, self.shape[1])
        return (outer, inner) if self.inner == PP else (inner, outer)

    def tensor_parallel_rank(self, rank: int) -> int:
        """The position of global ``rank`` among the processes sharing its stages."""
        return rank % self.tensor_parallel_size

    def rank(self, dp_rank: int, pp_rank: int, tp_rank: int = 0) -> int:
        if self.inner == PP:
            position = dp_rank * self.pipeline_size + pp_rank
        else:
            position = pp_rank * self.data_parallel_size + dp_rank
        return position * self.tensor_parallel_size + tp_rank

    def pipeline_ranks(self, dp_rank: int, tp_rank: int = 0) -> list[int]:
        """Global ranks of pipeline ``dp_rank`` (its processes of tensor-parallel rank ``tp_rank``), by pipeline
        rank."""
        return [self.rank(dp_rank, p, tp_rank) for p in range(self.pipeline_size)]

    def replica_ranks(self, pp_rank: int, tp_rank: int = 0) -> list[int]:
        """Global ranks holding pipeline position ``pp_rank`` (tensor-parallel rank ``tp_rank``), by data-parallel
        rank."""
        return [self.rank(d, pp_rank, tp_rank) for d in range(self.data_parallel_size)]

    def stage_positions(self) -> list[list[int]]:
        """For every stage position (pipeline rank, tensor-parallel rank), the global ranks holding it, by
        data-parallel rank: the processes with equal weights."""
        positions = [(p, t) for p in range(self.pipeline_size) for t in range(self.tensor_parallel_size)]
        return [self.replica_ranks(p, t) for p, t in positions]

    def replica_members(self, dp_rank: int) -> list[int]:
        """Every global rank of data-parallel replica ``dp_rank`` (all its stage positions and tensor-parallel ranks),
        ascending."""
        return sorted(
            self.rank(dp_rank, p, t) for p in range(self.pipeline_size) for t in range(self.tensor_parallel_size)
        )


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
        self._replica: Any = None  # set with the mesh

    def build(self, settings: PipelineSettings, device_type: str) -> DeviceMesh:
        """The mesh of resolved ``settings`` (collective: every rank calls it)."""
        from lightning_pipe.comm import collectives

        self.layout = MeshLayout(
            int(settings.pipeline_size),  # type: ignore[arg-type]
            settings.data_parallel_size,
            settings.inner_axis,  # type: ignore[arg-type]
            settings.tensor_parallel_size,
        )
        world = collectives.world_group()
        built = None if self._mesh is None else (tuple(self._mesh.shape), tuple(self._mesh.mesh_dim_names or ()))
        if self._world is not world or built != (self.layout.shape, self.layout.axis_names):
            self._mesh, self._world = build_mesh(self.layout, device_type), world
            self._replica = self._replica_group(self.layout, self._mesh)
        return self._mesh

    @property
    def replica_group(self) -> Any:
        """The group of every process of this rank's data-parallel replica (its stages and their tensor-parallel
        shards): the ranks that write a replicated checkpoint together."""
        return self._replica

    @staticmethod
    def _replica_group(layout: MeshLayout, mesh: DeviceMesh) -> Any:
        from lightning_pipe.comm import collectives

        if layout.tensor_parallel_size == 1:
            return axis_group(mesh, PP)  # a replica is one pipeline
        if layout.data_parallel_size == 1:
            return collectives.world_group()
        # Every rank makes every replica's group, in one order (a collective).
        groups = [collectives.new_group(layout.replica_members(d)) for d in range(layout.data_parallel_size)]
        return groups[axis_rank(mesh, DP)]


class MeshAxes:
    """The strategy's place on its mesh, axis by axis (a mixin of ``PipelineParallelStrategy``, which sets
    ``_mesh`` when the processes start): the mesh, this process's rank along each axis and the group of each."""

    _mesh: DeviceMesh | None = None
    #: the strategy's :class:`~lightning_pipe.settings.PipelineSettings`
    _settings: Any

    @property
    def device_mesh(self) -> DeviceMesh:
        """The process topology: axes ``"pp"`` (stages of one pipeline), ``"dp"`` (data-parallel replicas) and
        ``"tp"`` (the processes sharing a stage, innermost)."""
        if self._mesh is None:
            raise PipelineUsageError("The device mesh is built when the processes start (setup_environment).")
        return self._mesh

    @property
    def pipeline_rank(self) -> int:
        return axis_rank(self.device_mesh, PP) if self._mesh is not None else 0

    @property
    def data_parallel_rank(self) -> int:
        return axis_rank(self.device_mesh, DP) if self._mesh is not None else 0

    @property
    def tensor_parallel_rank(self) -> int:
        return axis_rank(self.device_mesh, TP) if self._mesh is not None else 0

    @property
    def pipeline_group(self) -> Any:
        return axis_group(self.device_mesh, PP)

    @property
    def data_parallel_group(self) -> Any:
        return axis_group(self.device_mesh, DP)

    @property
    def tensor_parallel_group(self) -> Any:
        return axis_group(self.device_mesh, TP)

    @property
    def tensor_parallel_size(self) -> int:
        """Processes sharing every stage (``tensor_parallel``): the size of axis ``"tp"``, known before the mesh."""
        return int(self._settings.tensor_parallel_size)
