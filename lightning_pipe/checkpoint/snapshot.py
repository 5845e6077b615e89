"""In-memory snapshots for recovery in place (``snapshot_every``; docs/reliability.md).

Every ``snapshot_every`` training steps each rank takes what a disk checkpoint of that step holds for it (Lightning's
checkpoint dict as ``trainer.save_checkpoint`` builds it: its stages' weights and optimizer states by name, LR
schedulers, loops, callbacks) and its resume point (random streams, data position, taken where training continues,
as for a disk save: :class:`~lightning_pipe.reliability.loaders.Continuation`). The step pays only for the copy of
the dict's tensors to host memory (:func:`stage`); a thread serialises the copy and exchanges it with the buddy rank
(:func:`lightning_pipe.reliability.recovery.buddies`) on a gloo group of its own (:class:`Snapshots`). After a rank
was lost, the ranks of the next generation agree on the newest step every rank can restore (its own copy, or the one
its buddy holds), the buddies send the replacement its copies, and ``fit`` resumes through the strategy's
``load_checkpoint`` from memory (:data:`MEMORY`): the same restore as a disk resume, without a file.
"""

from __future__ import annotations

import copy
import io as bytes_io
import threading
import time
from collections import deque
from typing import Any, Optional

import torch
from lightning.pytorch import Callback

from lightning_pipe.comm import collectives
from lightning_pipe.compat import lightning as pl_compat
from lightning_pipe.errors import PipelineCheckpointError
from lightning_pipe.reliability import recovery

#: The ``ckpt_path`` of a ``fit`` resumed from the snapshot the ranks agreed on (no file of that name is read).
MEMORY = "lightning-pipe:snapshot"


def _to_bytes(obj: Any) -> bytes:
    buffer = bytes_io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(bytes_io.BytesIO(data), weights_only=False)


# ---------------------------------------------------------------------------------------------------- the copy
class Staged:
    """A checkpoint dict whose tensors are copies in host memory; on CUDA the copies run on a side stream, and
    :meth:`ready` (the next optimizer step, the serialising thread) waits for them."""

    def __init__(self, checkpoint: Any, event: Optional[torch.cuda.Event] = None) -> None:
        self.checkpoint, self._event = checkpoint, event

    def ready(self, stream: Optional[Any] = None) -> None:
        """``stream`` (a CUDA stream) waits for the copies before its next kernels; without, this thread waits."""
        if self._event is None:
            return
        if stream is not None:
            stream.wait_event(self._event)
        else:
            self._event.synchronize()


def _tensors(obj: Any, found: dict[int, torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        found[id(obj)] = obj
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, found)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            _tensors(value, found)


def stage(checkpoint: Any, pinned: dict[int, torch.Tensor]) -> Staged:
    """A copy of ``checkpoint`` whose tensors live in host memory (everything else deep-copied: a callback's state
    may change after this returns). CPU tensors are cloned now; CUDA tensors are copied into pinned host buffers on a
    side stream that first waits for the work queued so far. ``pinned`` keeps those buffers between snapshots (by
    position: the same dict layout reuses them)."""
    found: dict[int, torch.Tensor] = {}
    _tensors(checkpoint, found)
    memo: dict[int, Any] = {}
    event, side = None, None
    for index, (key, tensor) in enumerate(found.items()):
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            memo[key] = tensor.clone()
            continue
        if side is None:
            side = torch.cuda.Stream(tensor.device)
            side.wait_stream(torch.cuda.current_stream(tensor.device))
        buffer = pinned.get(index)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = pinned[index] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            buffer.copy_(tensor, non_blocking=True)
        tensor.record_stream(side)  # its memory is not reused before the copy ran, should it be freed meanwhile
        memo[key] = buffer
    if side is not None:
        event = torch.cuda.Event()
        event.record(side)
    return Staged(copy.deepcopy(checkpoint, memo), event)


# ---------------------------------------------------------------------------------------------------- the copies
class Snapshots:
    """This rank's snapshots (``own``) and its buddy's (``held``), by global step; they outlive Trainer entries.

    A snapshot is serialised and exchanged by a background thread (:meth:`submit`), one at a time, on a gloo group
    of its own (:meth:`use_group`; every rank issues the same exchanges in the same order there, and the step's
    point-to-point transfers on the default group cannot interleave with them). Its step becomes *complete* once
    every rank has both copies of it: its own and its buddy's (a barrier on that group, after the exchange). A copy
    of a step older than the newest complete one is dropped; so at any moment every rank holds (or its buddy holds
    for it) the newest step any rank knows complete, and a kill during an exchange leaves that step restorable.
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self.own: dict[int, bytes] = {}
        self.held: dict[int, bytes] = {}
        #: steps of which every rank had both copies (a barrier on the snapshot group passed)
        self.complete: set[int] = set()
        #: the snapshot the running ``fit`` resumes from (set by :meth:`agree`)
        self.restoring: Optional[bytes] = None
        #: seconds the last snapshot blocked its step (the copy to host memory), the seconds its thread took
        #: (serialising, the exchange, the barrier), and its size (measured; docs/benchmarks.md)
        self.last_seconds = 0.0
        self.last_background_seconds = 0.0
        self.last_bytes = 0
        #: for each stage position, the global ranks holding it by data-parallel rank (where the buddies are:
        #: :func:`~lightning_pipe.reliability.recovery.buddies`); set by the strategy when the mesh exists
        self.replicas: list[list[int]] = []
        #: (step, seconds blocked, seconds in the background) of the recent snapshots (benchmarks/snapshot_overhead.py)
        self.timings: deque[tuple[int, float, float]] = deque(maxlen=1000)
        #: pinned host buffers of the CUDA copies, reused from one snapshot to the next
        self.pinned: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        #: bumped by :meth:`abandon`: a thread of an older epoch changes nothing any more
        self._epoch = 0
        self._group: Optional[tuple[Any, Any]] = None  # (the world group it was made for, the snapshot group)

    @property
    def any(self) -> bool:
        return bool(self.own)

    def nbytes(self) -> int:
        """Host memory the snapshots take on this rank."""
        with self._lock:
            return sum(map(len, self.own.values())) + sum(map(len, self.held.values()))

    def use_group(self) -> Any:
        """The gloo group of the exchanges, one per process group (collective: every rank calls it at the same
        point, after any other group it makes there)."""
        world = collectives.world_group()
        if self._group is None or self._group[0] is not world:
            size = collectives.group_size(world)
            self._group = (world, collectives.new_group(list(range(size)), backend="gloo") if size > 1 else world)
        return self._group[1]

    def release_group(self) -> None:
        """A peer was lost: forget the broken run's groups (the world group and the exchanges'). gloo closes a
        group's connections only with its last reference, and a peer of another replica may be blocked on this
        rank in a world collective (Lightning's broadcast at the start of a training step, while this rank failed
        in validation) until this rank's connections close."""
        self._group = None

    # ------------------------------------------------------------------ taking one
    def submit(self, step: int, staged: Staged, point: Any, ranks_per_node: int) -> None:
        """Serialise ``staged`` with this rank's resume point ``point`` and exchange copies with the buddies, in the
        background (every rank submits the same steps in the same order)."""
        self.wait()
        group, epoch, blocked = self.use_group(), self._epoch, self.last_seconds
        world, rank = collectives.group_size(collectives.world_group()), collectives.world_rank()
        to, source = self._buddy_of(rank, world, ranks_per_node), self._held_by(rank, world, ranks_per_node)

        def run() -> None:
            began = time.perf_counter()
            try:
                staged.ready()
                data = _to_bytes({"checkpoint": _to_bytes(staged.checkpoint), "point": point})
                self._insert(epoch, self.own, step, data)
                if world > 1:
                    self._insert(epoch, self.held, step, collectives.exchange_bytes(data, to, source, group))
                    collectives.barrier(group)  # every rank has both copies of `step`
                self._completed(epoch, step, len(data))
            except Exception as err:  # raised in the main thread at the next snapshot or the end of `fit`
                with self._lock:
                    if epoch == self._epoch:  # an abandoned exchange fails once the broken run's groups are dropped
                        self._error = err
            finally:
                self.last_background_seconds = time.perf_counter() - began
                self.timings.append((step, blocked, self.last_background_seconds))

        self._thread = threading.Thread(target=run, name=f"lightning-pipe snapshot {step}", daemon=True)
        self._thread.start()

    def _insert(self, epoch: int, store: dict[int, bytes], step: int, data: bytes) -> None:
        with self._lock:
            if epoch == self._epoch:
                store[step] = data

    def _completed(self, epoch: int, step: int, nbytes: int) -> None:
        with self._lock:
            if epoch != self._epoch:
                return
            self.complete = {step}
            for store in (self.own, self.held):
                for old in [s for s in store if s < step]:
                    del store[old]
            self.last_bytes = nbytes

    def wait(self) -> None:
        """Wait for the snapshot in the background; its error (a lost buddy, say) is raised here, as it was."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def abandon(self) -> None:
        """After a failure: the snapshot in the background (if any) changes nothing any more; what it had added
        stays (each copy there is whole), and the agreement decides which step every rank can restore."""
        with self._lock:
            self._epoch += 1
        self._thread, self._error = None, None

    # ------------------------------------------------------------------ after a failure
    def agree(self, ranks_per_node: int) -> int:
        """The newest step every rank can restore; the ranks that lack their copy of it get it (and the copy they
        hold for another rank) from those that have it (collective, on the new process group)."""
        world, rank = collectives.group_size(collectives.world_group()), collectives.world_rank()
        with self._lock:
            mine = (sorted(self.own), sorted(self.held))
        holdings = collectives.all_gather_object(mine, collectives.world_group())
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
            for other in [s for s in store if s != step]:
                del store[other]
        self.complete = {step}  # every rank has both copies of it now
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
    """Takes a snapshot after every ``every``-th optimizer step: the copy to host memory there, the resume point at
    the next batch request (as a disk save's), where the thread that serialises and exchanges it starts. Installed by
    the strategy for one ``fit``, after the user's callbacks (a ``ModelCheckpoint`` of the same step has saved
    already, and its state is in the snapshot)."""

    def __init__(self, snapshots: Snapshots, continuation: Any, ranks_per_node: int) -> None:
        self.snapshots, self.continuation, self.ranks_per_node = snapshots, continuation, ranks_per_node
        self._taken = -1
        self._staged: Optional[Staged] = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == 0 or step % self.snapshots.every or step == self._taken or trainer.sanity_checking:
            return
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # inside an accumulation window: the optimizer has not stepped for this batch
        self._taken = step
        start = time.perf_counter()
        self.snapshots.wait()  # one snapshot in the background at a time (and its error, if any, now)
        staged = self._staged = stage(pl_compat.dump_checkpoint(trainer), self.snapshots.pinned)
        self.snapshots.last_seconds = time.perf_counter() - start

        def submit(point: Any) -> None:
            self.snapshots.submit(step, staged, point, self.ranks_per_node)

        self.continuation.when_training_continues(submit)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """On CUDA, the copies to host memory finish before the optimizer changes what they copy."""
        if self._staged is not None:
            device = trainer.strategy.root_device
            self._staged.ready(torch.cuda.current_stream(device) if device.type == "cuda" else None)
            self._staged = None
