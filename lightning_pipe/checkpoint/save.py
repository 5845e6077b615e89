"""Where checkpoints are written: a save in two halves, committed only when both are on disk.

A save writes (1) *the state*: model and optimizer shards (``torch.distributed.checkpoint``), LR schedulers, the
trainer state; synchronously, or asynchronously (``async_save``: the step waits only while this rank's state is copied
to host memory, a thread writes it); and (2) every rank's *resume point*: its random streams and data-loader epoch
starts at the moment training continues after the save (:mod:`lightning_pipe.reliability.loaders`). For a save during
training that moment is the next batch request, not the save itself: a validation run after a save at the end of a
step draws from the streams too, and a resumed run skips it. Global rank 0 then writes the manifest and renames the
temporary directory into place; until then the directory is ``<name>.tmp-<id>`` without a manifest, and nothing loads
or finds it. A failure at any point leaves the previous checkpoint of that name complete.

:class:`CheckpointWriter` keeps the rules: a new save waits for the previous asynchronous write (one staged copy at a
time); a checkpoint is removed (``save_top_k``) only once every newer save is committed; the errors of a background
write are raised on every rank at the next save, removal wait or end of the Trainer entry (``finish``).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from lightning_pipe.checkpoint import format as fmt
from lightning_pipe.checkpoint import optim
from lightning_pipe.checkpoint.io import Topology, agree, local_step
from lightning_pipe.comm import collectives
from lightning_pipe.errors import PipelineCheckpointError


@dataclass
class PendingSave:
    """One save between its start and its commit."""

    path: Path
    tmp: Path
    token: str
    #: what global rank 0 writes last, at the commit (``None`` on the other ranks)
    manifest: Optional[dict[str, Any]]
    #: the asynchronous write of this rank's shards (``None``: written already, or nothing to write here)
    write: Optional[Future] = None
    resume_written: bool = False
    committed: bool = False
    error: Optional[str] = None
    #: checkpoints whose removal waits for this save's commit
    removals: list[Path] = field(default_factory=list)

    @property
    def written(self) -> bool:
        return self.write is None or (self.write.done() and self.write.exception() is None)


# ---------------------------------------------------------------------------------------------------- the halves
def start_save(
    checkpoint: dict[str, Any],
    path: Path,
    topo: Topology,
    token: str,
    module_class: str,
    param_groups: optim.ParamGroups | None = None,
    write_group: Any = None,
    network_record: Mapping[str, Any] | None = None,
) -> PendingSave:
    """Write Lightning's ``checkpoint`` dict into ``path``'s temporary directory (collective): the trainer state and
    schedulers now, the shards now or, with ``write_group`` (a process group of its own), from a thread after a copy
    to host memory. The save is committed by :func:`commit` once the resume points are in too.

    ``checkpoint["state_dict"]`` and ``checkpoint["optimizer_states"]`` hold this rank's entries; ``token`` is the same
    on every rank; ``param_groups`` goes into the manifest with optimizer states, for ``consolidate --with-optimizer``;
    ``network_record`` (the network's ``ModelKind.record``) too, for ``export-hf``.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    tmp = fmt.temporary_path(path, token)
    problems: list[str] = []
    if topo.global_rank == 0:
        local_step(problems, _prepare, path, tmp)
    agree(problems, f"Could not start saving checkpoint {str(path)!r}")

    state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
    optimizer_states = checkpoint.pop("optimizer_states", None)
    schedulers = checkpoint.pop("lr_schedulers", None)
    networks = checkpoint.pop(fmt.HYPERPARAMETER_NETWORKS, None)  # checkpoint/hparams.py: for the manifest
    for i, osd in enumerate(optimizer_states or []):
        state[f"optimizer_{i}"] = osd
    write = None
    # Replicated stages hold identical states: only the first replica's processes write (each its tensor-parallel
    # shards). Sharded ones: every rank writes its shards (an entry several ranks hold whole, such as a step count or
    # a layer kept whole by tensor parallelism, is written once).
    if topo.sharded or topo.data_parallel_rank == 0:
        group = collectives.world_group() if topo.sharded else topo.replica_group
        alone = collectives.group_size(group) == 1  # a one-rank pipeline of replicated stages writes alone
        writer = dcp.FileSystemWriter(tmp)
        if write_group is None:
            local_step(problems, lambda: dcp.save(state, storage_writer=writer, process_group=group, no_dist=alone))
        else:
            # Copied to host memory before this returns; written by DCP's thread, which synchronises the writers on
            # `write_group` (not on the group the step's collectives use meanwhile).
            write = local_step(
                problems, lambda: dcp.async_save(state, storage_writer=writer, process_group=write_group, no_dist=alone)
            )
    if schedulers is not None and topo.data_parallel_rank == 0 and topo.tensor_parallel_rank == 0:
        local_step(problems, save_file, schedulers, tmp / fmt.scheduler_file(topo.pipeline_rank))
    manifest = None
    if topo.global_rank == 0:
        manifest = fmt.build_manifest(
            pipeline_size=topo.pipeline_size,
            data_parallel_size=topo.data_parallel_size,
            stages_per_rank=topo.stages_per_rank,
            schedule=topo.schedule,
            optimizers=len(optimizer_states or []),
            lr_schedulers=schedulers is not None,
            module_class=module_class,
            param_groups=param_groups if optimizer_states else None,
            aliases=topo.aliases,
            sharded=topo.sharded,
            tensor_parallel_size=topo.tensor_parallel_size,
        )
        manifest.update(
            {
                fmt.GLOBAL_STEP: int(checkpoint.get("global_step", 0)),
                fmt.EPOCH: int(checkpoint.get("epoch", 0)),
                fmt.SAVED_AT: time.time(),
                fmt.RESUME_FILES: [fmt.resume_file(r) for r in range(topo.world_size)],
                fmt.NETWORK_PREFIX: topo.network_prefix,
            }
        )
        if network_record is not None:
            manifest[fmt.NETWORK_RECORD] = dict(network_record)
        if networks:
            manifest[fmt.HYPERPARAMETER_NETWORKS] = networks
        local_step(problems, save_file, checkpoint, tmp / fmt.TRAINER_STATE)
    agree(problems, f"Saving checkpoint {str(path)!r} failed; the previous checkpoint of that name is untouched")
    return PendingSave(path, tmp, token, manifest, write)


def write_resume_point(point: Mapping[str, Any], tmp: Path, global_rank: int) -> None:
    save_file(dict(point), tmp / fmt.resume_file(global_rank))


def commit(tmp: Path, path: Path, token: str, manifest: Mapping[str, Any]) -> None:
    """Write the manifest (last: a directory without one was never completely written), then rename ``tmp`` to
    ``path``; a previous ``path`` is moved aside first and deleted only after the rename."""
    with open(tmp / fmt.MANIFEST, "w") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    replace_directory(tmp, path, token)


def replace_directory(tmp: Path, path: Path, token: str) -> None:
    """Rename the complete directory ``tmp`` to ``path``; a previous ``path`` is moved aside first and deleted only
    after the rename."""
    old = None
    if path.exists() or path.is_symlink():
        old = fmt.replaced_path(path, token)
        os.rename(path, old)
    os.rename(tmp, path)
    if old is not None:
        _delete(old)


def _prepare(path: Path, tmp: Path) -> None:
    # Leftovers of saves of this name that were killed: nothing can load them.
    for stale in fmt.leftovers(path):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)


def save_file(obj: Any, file: Path) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    with open(file, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _delete(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def remove(path: Path, token: str) -> None:
    """Delete a checkpoint (a directory, a file, or a link to either); a directory is first renamed to a transient
    name, so an interrupted deletion never leaves a partial directory under a checkpoint's name."""
    path = Path(path)
    if fmt.is_transient(path):
        raise PipelineCheckpointError(f"Refusing to remove {str(path)!r}: it belongs to a save or removal in progress.")
    if path.is_dir() and not path.is_symlink():
        trash = fmt.trash_path(path, token)
        os.rename(path, trash)
        shutil.rmtree(trash)
    elif path.exists() or path.is_symlink():
        path.unlink()


# ---------------------------------------------------------------------------------------------------- the writer
class CheckpointWriter:
    """The saves of one strategy: starts them, completes their resume points, commits them, holds back removals.

    ``topology`` says where this process sits; ``write_group`` gives the process group of asynchronous writes
    (``None``: synchronous saves).
    """

    def __init__(self, topology: Callable[[], Topology], write_group: Optional[Callable[[], Any]] = None) -> None:
        self._topology = topology
        self._write_group = write_group
        self._pending: list[PendingSave] = []
        self._lock = threading.Lock()

    @property
    def asynchronous(self) -> bool:
        return self._write_group is not None

    @property
    def pending(self) -> list[PendingSave]:
        """The saves started and not yet committed (or failed)."""
        return list(self._pending)

    def save(
        self,
        checkpoint: dict[str, Any],
        path: Path,
        token: str,
        module_class: str,
        param_groups: optim.ParamGroups | None = None,
        resume_point: Optional[Mapping[str, Any]] = None,
        network_record: Optional[Mapping[str, Any]] = None,
    ) -> PendingSave:
        """Start saving ``checkpoint`` as ``path`` (collective). With ``resume_point`` (this rank's, now) a
        synchronous save is committed before this returns; without, the save waits for :meth:`resume_point_ready`."""
        self.wait_for_writes()  # one staged copy at a time; the previous save's errors first
        self._drop_pending_of(Path(path))
        group = self._write_group() if self._write_group is not None else None
        topo = self._topology()
        pending = start_save(
            checkpoint, path, topo, token, module_class, param_groups, write_group=group, network_record=network_record
        )
        self._pending.append(pending)
        if pending.write is not None:
            pending.write.add_done_callback(lambda _: self._commit_if_ready(pending))
        if resume_point is not None:
            self.resume_point_ready(resume_point)
        return pending

    def resume_point_ready(self, point: Mapping[str, Any]) -> None:
        """Write this rank's resume point into every save waiting for one, agree, and commit those whose state is
        written (collective: every rank calls it at the same point of the run)."""
        waiting = [p for p in self._pending if not p.resume_written]
        if not waiting:
            return
        problems: list[str] = []
        rank = self._topology().global_rank
        for pending in waiting:
            local_step(problems, write_resume_point, point, pending.tmp, rank)
        names = ", ".join(repr(str(p.path)) for p in waiting)
        agree(problems, f"Writing the resume point of {names} failed; the previous checkpoints are untouched")
        for pending in waiting:
            pending.resume_written = True
            self._commit_if_ready(pending)
        if not self.asynchronous:
            self._settle(f"Could not move the saved checkpoint into place at {names}")

    def remove(self, path: Path, token: str) -> None:
        """Remove checkpoint ``path`` (on global rank 0) once no newer save is uncommitted; a save of ``path`` itself
        that is still pending is dropped instead."""
        path = Path(path)
        with self._lock:
            for pending in self._pending:
                if pending.path == path and not pending.committed:
                    self._pending.remove(pending)
                    shutil.rmtree(pending.tmp, ignore_errors=True)
                    return
            waiting = [p for p in self._pending if not p.committed and not p.error]
            if waiting:
                waiting[-1].removals.append(path)
                return
        remove(path, token)

    def finish(self, point: Optional[Mapping[str, Any]]) -> None:
        """Complete every pending save (collective): ``point`` is the resume point of those still waiting for one
        (the end of training), writes are waited for, and every rank raises the same error if one failed."""
        if point is not None:
            self.resume_point_ready(point)
        self.wait_for_writes()

    def abandon(self) -> None:
        """Forget the pending saves after a failure (no collective may run any more): their temporary directories
        stay until the next save of the same name removes them, the previous checkpoints stay complete."""
        with self._lock:
            self._pending.clear()

    def wait_for_writes(self) -> None:
        """Wait for every asynchronous write, commit what is ready, and agree on errors (collective)."""
        for pending in list(self._pending):
            if pending.write is None:
                continue
            try:
                pending.write.result()
            except Exception as err:  # DCP's CheckpointException gathers every rank's failure
                pending.error = pending.error or f"{type(err).__name__}: {err}"
            self._commit_if_ready(pending)
        self._settle("The asynchronous save of a checkpoint failed")

    def _settle(self, what: str) -> None:
        """Agree on the errors of this rank's saves, and forget the saves that are done (collective)."""
        with self._lock:
            errors = [f"{p.path}: {p.error}" for p in self._pending if p.error]
            self._pending = [p for p in self._pending if not p.error and not p.committed]
        agree(errors, f"{what}; the previous checkpoint of that name is untouched")

    def _drop_pending_of(self, path: Path) -> None:
        """A new save of ``path`` replaces one still waiting for its resume point (its directory is removed by the
        new save's start)."""
        with self._lock:
            self._pending = [p for p in self._pending if p.path != path or p.committed]

    def _commit_if_ready(self, pending: PendingSave) -> None:
        """Commit ``pending`` once its state and every rank's resume point are on disk (in the main thread or the
        writing thread, whichever finishes last); global rank 0 renames, then runs the removals it held back."""
        with self._lock:
            if pending.write is not None and pending.write.done() and pending.write.exception() is not None:
                error = pending.write.exception()
                pending.error = pending.error or f"{type(error).__name__}: {error}"
            if pending.committed or pending.error or not pending.resume_written or not pending.written:
                return
            if pending.manifest is not None:
                try:
                    commit(pending.tmp, pending.path, pending.token, pending.manifest)
                except OSError as err:
                    pending.error = f"{type(err).__name__}: {err}"
                    return
            pending.committed = True
            removals, pending.removals = pending.removals, []
            for path in removals:
                try:
                    remove(path, pending.token)
                except (OSError, PipelineCheckpointError) as err:
                    pending.error = f"removing {str(path)!r} after it: {type(err).__name__}: {err}"
