"""The process topology: a ``DeviceMesh`` with a data-parallel axis ``"dp"`` and a pipeline axis ``"pp"``.

The strategy builds the mesh once per default process group (``init_device_mesh``) and hands it to whoever needs
it: the pipeline (``"pp"`` group), gradient synchronisation and metrics (``"dp"`` group), checkpoints, and the user's
``configure_model`` as ``self.device_mesh``. The placement of ranks on the mesh is a pure function, tested without a
process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from lightning_pipe.errors import PipelineConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DP, PP = "dp", "pp"
#: Which axis holds consecutive ranks (ranks on one node when the launcher fills nodes in order).
InnerAxis = Literal["dp", "pp"]


def check_inner_axis(inner_axis: str) -> None:
    if inner_axis not in (PP, DP):
        raise PipelineConfigError(
            f"`inner_axis={inner_axis!r}` is not one of 'dp', 'pp'. Use 'dp' to keep each stage's data-parallel"
            " replicas on consecutive ranks (one node), or 'pp' to keep each pipeline's stages there."
        )


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
