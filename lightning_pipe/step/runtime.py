"""This rank's part of the pipeline: its stage modules, where every other stage lives, and the group joining them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_pipe.comm import collectives, transport
from lightning_pipe.comm.dtensor import MeshLookup
from lightning_pipe.split.builder import Split
from lightning_pipe.step.stage import StageModule


def stage_modules(split: Split) -> dict[int, StageModule]:
    """The runnable stages of ``split``, made on the first call and kept with the split: per-stage wrappers that
    cannot be removed (FSDP) stay on them for later Trainer entries."""
    if split.stages is None:
        split.stages = {
            s: StageModule(body, s, split.num_stages, split.stage_call, split.absent.get(s, ()))
            for s, body in split.bodies.items()
        }
    return dict(split.stages)


class PipelineRuntime:
    """The stages one rank runs (:class:`StageModule`, by stage index) and the placement of all stages.

    ``stage_ranks[s]`` is the pipeline rank holding stage ``s``; ``group`` is this pipeline's process group (one rank
    for a one-process pipeline) and ``group_ranks`` its global ranks by pipeline rank. ``mesh_of`` gives the
    strategy's (sub)mesh of some axes: where a DTensor activation received from another stage is rebuilt.
    """

    def __init__(
        self,
        stages: Mapping[int, StageModule],
        num_stages: int,
        stage_ranks: Sequence[int],
        group: Any,
        device: torch.device,
        mesh_of: MeshLookup,
    ) -> None:
        self.stages = dict(sorted(stages.items()))
        self.mesh_of = mesh_of
        self.num_stages = num_stages
        self.stage_ranks = list(stage_ranks)
        self.group = group
        self.group_ranks = collectives.group_ranks(group)
        self.device = device
        self.has_first = 0 in self.stages
        self.has_last = num_stages - 1 in self.stages
        #: global rank of the process holding the last stage (the source of each step's outcome)
        self.last_stage_global_rank = self.global_rank_of(num_stages - 1)

    @property
    def pipeline_size(self) -> int:
        return len(self.group_ranks)

    @property
    def pipeline_rank(self) -> int:
        if self.pipeline_size == 1:
            return 0
        return self.group_ranks.index(collectives.world_rank())

    def global_rank_of(self, stage: int) -> int:
        return self.group_ranks[self.stage_ranks[stage]]

    def attach_timeline(self, recorder: Any) -> None:
        """Report this rank's schedule actions to ``recorder`` (a
        :class:`~lightning_pipe.measure.timeline.TimelineRecorder`; ``None`` detaches it)."""
        for stage in self.stages.values():
            stage.recorder = recorder

    def to_first_rank(self, output: Any) -> Any:
        """The last stage's ``output`` on pipeline rank 0 (moved once when the last stage lives elsewhere), ``None`` on
        the other ranks: where ``trainer.predict`` returns predictions."""
        source = self.stage_ranks[self.num_stages - 1]
        me = self.pipeline_rank
        if source == 0:
            return output if me == 0 else None
        if self.has_last:
            transport.wait_all(transport.send_object(output, self.group_ranks[0], self.group, self.device))
            return None
        if me == 0:
            return transport.recv_object(self.last_stage_global_rank, self.group, self.device, self.mesh_of)
        return None
