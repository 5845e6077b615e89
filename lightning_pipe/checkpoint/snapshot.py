"""In-memory snapshots for recovery in place (``snapshot_every``; docs/reliability.md).

Every ``snapshot_every`` training steps each rank takes what a disk checkpoint of that step holds for it (Lightning's
checkpoint dict as ``trainer.save_checkpoint`` builds it: its stages' weights and optimizer states by name, LR
schedulers, loops, callbacks) and its resume point (random streams, data position, taken where training continues,
as for a disk save: :class:`~lightning_pipe.reliability.loaders.Continuation`), serialised to host memory, and sends
a copy to its buddy rank (:func:`lightning_pipe.reliability.recovery.buddy_of`). After a rank was lost, the ranks of
the next generation agree on the newest step every rank can restore (its own copy, or the one its buddy holds), the
buddies send the replacement its copies, and ``fit`` resumes through the strategy's ``load_checkpoint`` from memory
(:data:`MEMORY`): the same restore as a disk resume, without a file.
"""

from __future__ import annotations

import io as bytes_io
from typing import Any, Optional

import torch
from lightning.pytorch import Callback

from lightning_pipe.comm import collectives
from lightning_pipe.compat import lightning as pl_compat
from lightning_pipe.errors import PipelineCheckpointError
from lightning_pipe.reliability import recovery

#: The ``ckpt_path`` of a ``fit`` resumed from the snapshot the ranks agreed on (no file of that name is read).
MEMORY = "lightning-pipe:snapshot"
#: Snapshots kept per rank, of its own and of its buddy's (the newest two: one may be incomplete on some rank).
KEEP = 2


def _to_bytes(obj: Any) -> bytes:
    buffer = bytes_io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(bytes_io.BytesIO(data), weights_only=False)


class Snapshots:
    """This rank's snapshots (``own``) and its buddy's (``held``), by global step; they outlive Trainer entries."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.own: dict[int, bytes] = {}
        self.held: dict[int, bytes] = {}
        #: the snapshot the running ``fit`` resumes from (set by :meth:`agree`)
        self.restoring: Optional[bytes] = None
        #: seconds the last snapshot blocked training, and its size (measured; docs/benchmarks.md)
        self.last_seconds = 0.0
        self.last_bytes = 0
        #: for each stage position, the global ranks holding it by data-parallel rank (where the buddies are:
        #: :func:`~lightning_pipe.reliability.recovery.buddies`); set by the strategy when the mesh exists
        self.replicas: list[list[int]] = []

    @property
    def any(self) -> bool:
        return bool(self.own)

    def nbytes(self) -> int:
        """Host memory the snapshots take on this rank."""
        return sum(map(len, self.own.values())) + sum(map(len, self.held.values()))

    def _keep(self, store: dict[int, bytes], step: int, data: bytes) -> None:
        store[step] = data
        for old in sorted(store)[:-KEEP]:
            del store[old]

    def store(self, step: int, checkpoint: bytes, point: Any, ranks_per_node: int) -> None:
        """Keep this rank's snapshot of ``step`` and exchange copies with the buddies (collective: every rank)."""
        data = _to_bytes({"checkpoint": checkpoint, "point": point})
        self._keep(self.own, step, data)
        world, rank = collectives.group_size(collectives.world_group()), collectives.world_rank()
        if world > 1:
            to, source = self._buddy_of(rank, world, ranks_per_node), self._held_by(rank, world, ranks_per_node)
            self._keep(self.held, step, collectives.exchange_bytes(data, to, source))
        self.last_bytes = len(data)

    def agree(self, ranks_per_node: int) -> int:
        """The newest step every rank can restore; the ranks that lack their copy of it get it (and the copy they
        hold for another rank) from those that have it (collective, on the new process group)."""
        world, rank = collectives.group_size(collectives.world_group()), collectives.world_rank()
        holdings = collectives.all_gather_object((sorted(self.own), sorted(self.held)), collectives.world_group())
        restorable = [
            set(holdings[r][0]) | set(holdings[self._buddy_of(r, world, ranks_per_node)][1]) for r in range(world)
        ]
        common = set.intersection(*restorable)
        if not common:
            listed = ", ".join(f"rank {r}: {sorted(steps) or 'none'}" for r, steps in enumerate(restorable))
            raise PipelineCheckpointError(
                f"No snapshot step can be restored on every rank ({listed}): a rank and its buddy were both lost, or"
                " the failure came before the first snapshot. The run restarts from the newest checkpoint on disk."
            )
        step = max(common)
        for r in range(world):
            if step in holdings[r][0]:
                continue
            buddy, held_for = self._buddy_of(r, world, ranks_per_node), self._held_by(r, world, ranks_per_node)
            if rank == buddy:
                collectives.send_bytes(self.held[step], r)
            if rank == r:
                self.own[step] = collectives.receive_bytes(buddy)
            if step in holdings[held_for][0] and held_for != r:
                if rank == held_for:
                    collectives.send_bytes(self.own[step], r)
                if rank == r:
                    self.held[step] = collectives.receive_bytes(held_for)
        for store in (self.own, self.held):
            for newer in [s for s in store if s > step]:
                del store[newer]
        self.restoring = self.own[step]
        return step

    def _buddy_of(self, rank: int, world: int, ranks_per_node: int) -> int:
        return recovery.buddy_of(rank, world, ranks_per_node, self.replicas)

    def _held_by(self, rank: int, world: int, ranks_per_node: int) -> int:
        return recovery.held_by(rank, world, ranks_per_node, self.replicas)

    def restore(self) -> tuple[dict[str, Any], Any]:
        """The checkpoint dict and resume point the agreed snapshot holds (a fresh copy: Lightning may change it)."""
        if self.restoring is None:
            raise PipelineCheckpointError(
                f"`ckpt_path={MEMORY!r}` resumes from an in-memory snapshot, which only a recovery in place sets up."
                " Pass a checkpoint path, or None."
            )
        data = _from_bytes(self.restoring)
        self.restoring = None
        return _from_bytes(data["checkpoint"]), data["point"]


class SnapshotCallback(Callback):
    """Takes a snapshot after every ``every``-th optimizer step; its resume point at the next batch request (as a
    disk save's), when the copies are exchanged. Installed by the strategy for one ``fit``, after the user's
    callbacks (a ``ModelCheckpoint`` of the same step has saved already, and its state is in the snapshot)."""

    def __init__(self, snapshots: Snapshots, continuation: Any, ranks_per_node: int) -> None:
        self.snapshots, self.continuation, self.ranks_per_node = snapshots, continuation, ranks_per_node
        self._taken = -1

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == 0 or step % self.snapshots.every or step == self._taken or trainer.sanity_checking:
            return
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # inside an accumulation window: the optimizer has not stepped for this batch
        self._taken = step
        import time

        start = time.perf_counter()
        checkpoint = _to_bytes(pl_compat.dump_checkpoint(trainer))  # the copy to host memory
        elapsed = time.perf_counter() - start

        def complete(point: Any) -> None:
            began = time.perf_counter()
            self.snapshots.store(step, checkpoint, point, self.ranks_per_node)
            self.snapshots.last_seconds = elapsed + time.perf_counter() - began

        self.continuation.when_training_continues(complete)
