"""Resuming a run as if it had never stopped: the checkpoints of one Trainer entry and where a restart resumes from.

:class:`CheckpointSession` belongs to one Trainer entry of the strategy: its :class:`~.save.CheckpointWriter` (saves in
two halves, asynchronous ones on a process group of their own) and its
:class:`~lightning_pipe.reliability.loaders.Continuation` (the training loaders' stand-ins, where resume points are
taken and given back). :func:`find_resume` is what a restarted ``fit`` resumes from: the newest complete checkpoint
(:mod:`.latest`) in this run's checkpoint directories (those of the Trainer's ``ModelCheckpoint`` callbacks, and
those earlier attempts recorded, :func:`lightning_pipe.reliability.restart.record_checkpoint_dirs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_pipe.checkpoint import latest
from lightning_pipe.checkpoint.io import Topology
from lightning_pipe.checkpoint.save import CheckpointWriter
from lightning_pipe.comm import collectives
from lightning_pipe.errors import PipelineCheckpointError
from lightning_pipe.reliability import loaders, restart


class CheckpointSession:
    """The checkpoints of one Trainer entry: saves, resume points, the training loaders' stand-ins.

    ``streams`` are the strategy's random streams (``lightning_pipe.step.rng.RngStreams``: ``state_dict(device)``,
    ``load_state_dict(state, device)``); ``write_group`` the process group of asynchronous writes (``None``:
    synchronous saves).
    """

    def __init__(
        self,
        trainer: Any,
        topology: Callable[[], Topology],
        streams: Any,
        device: torch.device,
        write_group: Optional[Any] = None,
    ) -> None:
        self.trainer = trainer
        self.writer = CheckpointWriter(topology, None if write_group is None else (lambda: write_group))
        self.continuation = loaders.Continuation(
            capture=lambda: streams.state_dict(device),
            restore=lambda state: streams.load_state_dict(state, device),
            batches_done=lambda: int(trainer.fit_loop.epoch_loop.batch_progress.current.ready),
        )
        #: set once the training loop is over: later saves take their resume point at once
        self.training_over = False
        self.failed = False

    def stand_in(self, dataloader: Any) -> Any:
        """The stand-in for a training loader (``process_dataloader`` while ``trainer.training``)."""
        if not self.trainer.training or self.trainer.sanity_checking:
            return dataloader
        return loaders.stand_in(dataloader, self.continuation)

    def resume_point_now(self) -> Optional[Mapping[str, Any]]:
        """This rank's resume point when a save's is *now*: outside training, or once it is over; ``None`` while
        training goes on (the save then waits for the next batch request)."""
        fitting = getattr(self.trainer.state.fn, "value", None) == "fit"
        if fitting and self.continuation.loaders and not self.training_over:
            return None
        return self.continuation.point()

    def save(
        self, checkpoint: dict[str, Any], path: Path, token: str, module_class: str, groups: Any, record: Any = None
    ) -> None:
        point = self.resume_point_now()
        self.writer.save(checkpoint, path, token, module_class, groups, resume_point=point, network_record=record)
        if not self.continuation.waiting and any(not p.resume_written for p in self.writer.pending):
            self.continuation.when_training_continues(self.writer.resume_point_ready)

    def resume_from(self, point: Optional[Mapping[str, Any]], path: Path) -> None:
        """Give ``point`` (this rank's, from checkpoint ``path``) back where training continues."""
        if point is None:
            rank_zero_warn(
                f"Checkpoint {str(path)!r} has no resume point for this layout (it was saved by another pipeline"
                " layout, by `fabric.save`, or by a lightning-pipe that kept none): the random streams (shuffling"
                " order, dropout) are not restored, so steps after the resume differ from an uninterrupted run's."
            )
        self.continuation.resume_from(None if point is None else dict(point))

    def end_of_training(self) -> None:
        """The training loop is over: saves waiting for a resume point take it now (collective)."""
        self.training_over = True
        self.continuation.flush()

    def finish(self) -> None:
        """End of the Trainer entry: every pending save completes (collective), unless the entry failed."""
        if self.failed:
            self.writer.abandon()
            return
        self.end_of_training()
        self.writer.finish(None)


def write_group(writers: list[int]) -> Any:
    """The gloo group an asynchronous save's writers synchronise on (collective: every rank makes it)."""
    return collectives.new_group(sorted(writers), backend="gloo")


def writer_ranks(topology: Topology) -> list[int]:
    """The global ranks that write shards: all with sharded stages, else the first replica's pipeline (collective)."""
    first = topology.sharded or topology.data_parallel_rank == 0
    flags = collectives.all_gather_object(first, collectives.world_group())
    return [rank for rank, writes in enumerate(flags) if writes]


# ---------------------------------------------------------------------------------------------------- restarts
def checkpoint_dirs(trainer: Any) -> list[str]:
    """The directories the Trainer's ``ModelCheckpoint`` callbacks save to, where already known (resolved in their
    ``setup``, or given as ``dirpath``)."""
    return [str(cb.dirpath) for cb in getattr(trainer, "checkpoint_callbacks", []) if getattr(cb, "dirpath", None)]


def record_run(trainer: Any, world_size: int, global_rank: int) -> None:
    """Let later attempts of a restartable run know where this one saves (global rank 0, once callbacks resolved
    their directories)."""
    if global_rank == 0 and getattr(trainer.state.fn, "value", None) == "fit":
        restart.record_checkpoint_dirs(checkpoint_dirs(trainer), world_size)


def find_resume(trainer: Any) -> Optional[Path]:
    """The newest complete checkpoint of this run (before the process group exists: every rank reads the file
    system, and the strategy checks that they agree); announces what it found."""
    world = int(getattr(trainer, "num_devices", 1)) * int(getattr(trainer, "num_nodes", 1))
    dirs = sorted(set(restart.recorded_checkpoint_dirs(world)) | set(checkpoint_dirs(trainer)))
    found = latest.newest_complete(Path(d) for d in dirs)
    attempt = restart.restart_count()
    if found is None:
        rank_zero_info(
            f"lightning-pipe: restart {attempt}: no complete checkpoint in {dirs or 'any known directory'}; training"
            " starts from the beginning."
        )
        return None
    rank_zero_info(
        f"lightning-pipe: restart {attempt}: resuming `fit` from {str(found.path)!r} (global step {found.global_step})."
    )
    return found.path


def check_same_resume(resumed_from: Optional[str]) -> None:
    """Every rank of a restarted run must resume from the same checkpoint (collective)."""
    chosen = collectives.all_gather_object(resumed_from, collectives.world_group())
    if len(set(chosen)) > 1:
        listed = ", ".join(f"rank {r}: {c or 'none'}" for r, c in enumerate(chosen))
        raise PipelineCheckpointError(
            f"The ranks of this restarted run found different checkpoints to resume from ({listed}). Checkpoint"
            " directories must be on a file system every rank sees, and not written while the run starts again."
        )
