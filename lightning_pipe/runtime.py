"""This rank's part of the pipeline: its stage modules, where every other stage lives, and the group joining them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_pipe import collectives
from lightning_pipe.side_inputs import CallBook, StageModule


class PipelineRuntime:
    """The stages one rank runs (:class:`StageModule`, by stage index) and the placement of all stages.

    ``stage_ranks[s]`` is the pipeline rank holding stage ``s``; ``group`` is this pipeline's process group (``None``
    for a one-process pipeline) and ``group_ranks`` its global ranks by pipeline rank.
    """

    def __init__(
        self,
        stages: Mapping[int, StageModule],
        num_stages: int,
        stage_ranks: Sequence[int],
        book: CallBook,
        group: Any,
        group_ranks: Sequence[int],
        device: torch.device,
    ) -> None:
        self.stages = dict(sorted(stages.items()))
        self.num_stages = num_stages
        self.stage_ranks = list(stage_ranks)
        self.book = book
        self.group = group
        self.group_ranks = list(group_ranks)
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

    @property
    def last_stage(self) -> StageModule:
        return self.stages[self.num_stages - 1]

    def global_rank_of(self, stage: int) -> int:
        return self.group_ranks[self.stage_ranks[stage]]

    def attach_timeline(self, recorder: Any) -> None:
        """Report this rank's schedule actions to ``recorder`` (a :class:`~lightning_pipe.timeline.TimelineRecorder`;
        ``None`` detaches it)."""
        for stage in self.stages.values():
            stage.recorder = recorder
