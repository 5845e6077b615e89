"""Every ``torch.distributed`` communication call of lightning-pipe, with its tensors on a device the group serves.

NCCL serves CUDA tensors only (a CPU tensor in an NCCL collective raises "No backend type associated with device type
cpu"); gloo serves CPU tensors (and CUDA ones by copying). A group whose backend is a per-device mix
(``"cpu:gloo,cuda:nccl"``, the strategy's default on CUDA) serves both. Each function here moves what it sends to a
device the group serves and hands results back on the caller's device, so no other module needs to know the backend.
``tests/test_architecture.py`` fails if a ``torch.distributed`` communication call appears anywhere else.
"""

from __future__ import annotations

import atexit
import copyreg
import gc
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

#: A ``dist.ProcessGroup``. Every function takes the group it communicates over: ``None`` never stands for "the
#: world" (:func:`world_group` is that group) nor for "nobody" (a one-rank group makes every call a no-op).
Group = Any


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


_DESTROY_AT_EXIT = False
_SETTLE_S = 0.2


def destroy_at_exit() -> None:
    """Destroy the default process group when this process exits normally (registered once per process).

    Without it, the interpreter's finalisation can destroy gloo's worker threads while they still hold work objects
    whose tensors reference Python objects: a rank that finished cleanly then dies with SIGABRT ("terminate called
    without an active exception"), and its launcher reports a crash. Lightning never destroys the group (a later
    Trainer in the same process reuses it), so the last moment is the exit. Register it before Lightning's launcher
    starts the other ranks: exit handlers run last-registered first, so rank 0 waits for its ranks (reliability/
    watchdog.py) before its group goes. After an uncaught exception nothing is destroyed: the failure report comes
    first, and a peer may still be waiting on this rank.
    """
    global _DESTROY_AT_EXIT
    if not _DESTROY_AT_EXIT:
        atexit.register(_destroy_if_clean)
        _DESTROY_AT_EXIT = True


def _destroy_if_clean() -> None:
    if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None:
        return
    if is_initialized():
        dist.destroy_process_group()
    # A gloo worker thread drops the work object of a collective a moment after the collective completes; on a busy
    # machine that moment can come after the interpreter's finalisation began, when the thread can no longer take the
    # GIL to free the object's tensors, and the process aborts (seen about once in 8 runs of a two-process script under
    # load). Groups still referenced (a Trainer in the script's globals holds its mesh) keep their threads until then:
    # free what is unreachable now, and hand the GIL to those threads for a moment while it can still be taken.
    gc.collect()
    time.sleep(_SETTLE_S)


def world_group() -> Group:
    """The default process group (``None`` before one exists): a new one means every subgroup must be rebuilt."""
    return dist.group.WORLD if is_initialized() else None


def world_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def group_ranks(group: Group) -> list[int]:
    """Global ranks of ``group`` in group-rank order."""
    if not is_initialized():
        return [0]
    return dist.get_process_group_ranks(group)


def group_size(group: Group) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def default_backend(device: torch.device) -> str:
    """``"cpu:gloo,cuda:nccl"`` on CUDA: NCCL moves activations and gradients, gloo the CPU tensors a step sends
    (a pure NCCL group raises on them); Lightning's default for any other device."""
    if device.type == "cuda":
        return "cpu:gloo,cuda:nccl"
    from lightning_pipe.compat.lightning import default_process_group_backend_for_device

    return default_process_group_backend_for_device(device)


def served_device(group: Group, preferred: torch.device) -> torch.device:
    """The device for tensors sent over ``group``: ``preferred`` if the group's backend serves its type, else one it
    serves (NCCL: the current CUDA device; gloo: the CPU)."""
    if not is_initialized():
        return preferred
    if preferred.type in served_device_types(str(dist.get_backend(group))):
        return preferred
    if "cuda" in served_device_types(str(dist.get_backend(group))) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def served_device_types(backend: str) -> set[str]:
    """Device types a backend string serves: ``"cpu:gloo,cuda:nccl"`` both, ``"nccl"`` CUDA, ``"gloo"`` CPU."""
    backend = backend.lower()
    if ":" in backend:
        return {part.split(":", 1)[0].strip() for part in backend.split(",")}
    return {"nccl": {"cuda"}, "gloo": {"cpu"}, "mpi": {"cpu", "cuda"}}.get(backend, {"cpu", "cuda"})


def _on(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    return tensor.to(served_device(group, tensor.device))


def new_group(ranks: list[int], backend: str | None = None) -> Group:
    """A process group of global ``ranks`` (collective: every rank calls it, for every group, in the same order);
    ``backend`` as ``torch.distributed.new_group``'s (``None``: the default group's)."""
    return dist.new_group(ranks, backend=backend)


# ---------------------------------------------------------------------------------------------------- collectives
def all_reduce_(tensor: torch.Tensor, group: Group, op: Any = None) -> torch.Tensor:
    """Sum (or ``op``) ``tensor`` over ``group`` in place."""
    if group_size(group) == 1:
        return tensor
    moved = _on(tensor, group)
    dist.all_reduce(moved, op=op if op is not None else dist.ReduceOp.SUM, group=group)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def all_reduce_start(tensor: torch.Tensor, group: Group) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Start summing ``tensor`` over ``group`` (asynchronously, in place); :func:`all_reduce_finish` completes it.

    Several started reductions run back to back on the group while the caller prepares the next one.
    """
    moved = _on(tensor, group)
    work = dist.all_reduce(moved, op=dist.ReduceOp.SUM, group=group, async_op=True) if group_size(group) > 1 else None
    return work, moved, tensor


def all_reduce_finish(handle: tuple[Any, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Wait for a reduction :func:`all_reduce_start` began; the result is in its tensor, which is returned."""
    work, moved, tensor = handle
    if work is not None:
        work.wait()
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def broadcast_(tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
    """Overwrite ``tensor`` with global rank ``src``'s, in place."""
    if group_size(group) == 1:
        return tensor
    moved = _on(tensor, group)
    dist.broadcast(moved, src, group=group)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def broadcast_object(obj: Any, src: int, group: Group, device: torch.device | None = None) -> Any:
    """``obj`` of global rank ``src``, on every rank of ``group`` (pickled)."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src, group=group, device=served_device(group, device or torch.device("cpu")))
    return box[0]


def all_gather(tensor: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape everywhere), in group-rank order, on the caller's device."""
    if group_size(group) == 1:
        return [tensor]
    moved = _on(tensor, group)
    out = [torch.empty_like(moved) for _ in range(group_size(group))]
    dist.all_gather(out, moved, group=group)
    return [t.to(tensor.device) for t in out]


def all_gather_into_(out: torch.Tensor, shard: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's ``shard`` concatenated into ``out`` (``group_size`` times its numel), as FSDP gathers parameters."""
    if group_size(group) == 1:
        return out.copy_(shard.reshape(out.shape))
    moved_out, moved = _on(out, group), _on(shard, group)
    dist.all_gather_into_tensor(moved_out, moved, group=group)
    return out.copy_(moved_out) if moved_out is not out else out


def reduce_scatter_(shard: torch.Tensor, full: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's ``1/group_size`` slice of the sum of every rank's ``full`` into ``shard``, as FSDP reduces
    gradients."""
    if group_size(group) == 1:
        return shard.copy_(full.reshape(shard.shape))
    moved_shard, moved = _on(shard, group), _on(full, group)
    dist.reduce_scatter_tensor(moved_shard, moved, group=group)
    return shard.copy_(moved_shard) if moved_shard is not shard else shard


def all_gather_object(obj: Any, group: Group, device: torch.device | None = None) -> list[Any]:
    """Every rank's ``obj``, in group-rank order (pickled)."""
    if group_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * group_size(group)
    if device is not None and device.type == "cuda":
        # all_gather_object communicates on the current CUDA device under NCCL.
        with torch.cuda.device(device):
            dist.all_gather_object(out, obj, group=group)
    else:
        dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: Group, device: torch.device | None = None) -> None:
    if not is_initialized():
        return
    if device is not None and device.type == "cuda" and "nccl" in str(dist.get_backend(group)).lower():
        dist.barrier(group=group, device_ids=[device.index if device.index is not None else 0])
    else:
        dist.barrier(group=group)


# ---------------------------------------------------------------------------------------------------- point to point
def isend(tensor: torch.Tensor, dst: int, group: Group, tag: int = 0) -> tuple[Any, torch.Tensor]:
    """Post a non-blocking send to global rank ``dst``; returns ``(work, buffer)``: keep both until :func:`wait`."""
    moved = _on(tensor.contiguous(), group)
    return dist.isend(moved, dst, group=group, tag=tag), moved


def irecv(tensor: torch.Tensor, src: int, group: Group, tag: int = 0) -> tuple[Any, torch.Tensor]:
    """Post a non-blocking receive from global rank ``src`` into ``tensor``, which must be on a device ``group`` serves
    (:func:`served_device`); returns ``(work, tensor)``: the data is there after :func:`wait`."""
    return dist.irecv(tensor, src, group=group, tag=tag), tensor


def recv_(tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
    """Receive into ``tensor`` from global rank ``src`` (blocking)."""
    moved = _on(tensor, group)
    dist.recv(moved, src, group=group)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


class Direct:
    """Point-to-point messages of CPU tensors over one group, through the group's CPU backend's own ``send`` and
    ``recv``: what :func:`isend` and :func:`irecv` do there, without ``torch.distributed``'s per-call argument checks,
    rank lookups and logging wrapper (measured on 2 processes, 2026-11-29: 31 µs of CPU to post a gloo receive this
    way, 50 through ``dist.irecv``). Ranks are global; each is looked up once. For a message sent every step."""

    def __init__(self, group: Group) -> None:
        from lightning_pipe.compat.torch import cpu_backend

        self.group = group
        #: ``None``: no CPU backend found, the public calls instead (which say why, if they fail)
        self._backend = cpu_backend(group)
        self._ranks: dict[int, int] = {}

    def _group_rank(self, rank: int) -> int:
        found = self._ranks.get(rank)
        if found is None:
            found = self._ranks[rank] = dist.get_group_rank(self.group, rank)
        return found

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> tuple[Any, torch.Tensor]:
        """Post a send of the contiguous CPU ``tensor`` to global rank ``dst``; ``(work, tensor)`` as :func:`isend`."""
        if self._backend is None:
            return isend(tensor, dst, self.group, tag)
        return self._backend.send([tensor], self._group_rank(dst), tag), tensor

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> tuple[Any, torch.Tensor]:
        """Post a receive into the CPU ``tensor`` from global rank ``src``; ``(work, tensor)`` as :func:`irecv`."""
        if self._backend is None:
            return irecv(tensor, src, self.group, tag)
        return self._backend.recv([tensor], self._group_rank(src), tag), tensor


def wait(pending: list[tuple[Any, torch.Tensor]]) -> None:
    for work, _buffer in pending:
        work.wait()


#: groups given out as a pickle reference during a run, by token (see :func:`picklable_groups`)
_BY_TOKEN: dict[str, Group] = {}


def _group_token(group: Group) -> tuple[Any, tuple[str]]:
    token = next((t for t, g in _BY_TOKEN.items() if g is group), None) or uuid.uuid4().hex
    _BY_TOKEN[token] = group
    return _group_by_token, (token,)


def _group_by_token(token: str) -> Group | None:
    """The group a reference was made from, in the process and run that made it; ``None`` elsewhere (what a metric
    without a group of its own holds)."""
    return _BY_TOKEN.get(token)


@contextmanager
def picklable_groups() -> Iterator[None]:
    """Within the block, a process group the strategy put on a user's object (a metric's ``process_group``) pickles
    and deep-copies as a reference: ``copy.deepcopy`` and a pickle loaded in this process and run get the same group,
    a pickle loaded elsewhere gets ``None``. torch's groups refuse to pickle, which broke ``torch.save(model)`` and
    EMA/SWA callbacks' copies of a module whose metrics the strategy bound to the data-parallel group."""
    cls = dist.ProcessGroup
    before = copyreg.dispatch_table.get(cls)
    copyreg.pickle(cls, _group_token)
    try:
        yield
    finally:
        if before is None:
            copyreg.dispatch_table.pop(cls, None)
        else:
            copyreg.dispatch_table[cls] = before
        _BY_TOKEN.clear()


# ---------------------------------------------------------------------------------------------------- bytes
def exchange_bytes(data: bytes, to: int, source: int, group: Group) -> bytes:
    """Send ``data`` to global rank ``to`` while receiving global rank ``source``'s, on ``group``."""
    size, other = torch.tensor([len(data)], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    for request in [dist.isend(size, to, group=group), dist.irecv(other, source, group=group)]:
        request.wait()
    payload, received = torch.frombuffer(bytearray(data), dtype=torch.uint8), torch.empty(int(other), dtype=torch.uint8)
    for request in [dist.isend(payload, to, group=group), dist.irecv(received, source, group=group)]:
        request.wait()
    return received.numpy().tobytes()


def send_bytes(data: bytes, to: int) -> None:
    """Send ``data`` to global rank ``to`` (default group), its length first."""
    dist.send(torch.tensor([len(data)], dtype=torch.int64), to)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), to)


def receive_bytes(source: int) -> bytes:
    """What :func:`send_bytes` sent from global rank ``source``."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, source)
    received = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(received, source)
    return received.numpy().tobytes()
