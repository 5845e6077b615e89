"""Starting a failed run again: how many times it was restarted, where its checkpoints are, and the supervisor that
restarts it under Lightning's launcher.

Under torchrun, ``--max-restarts=N`` makes the agent start every worker again after a failure (the failure board and
the watchdog end the others within seconds); ``TORCHELASTIC_RESTART_COUNT`` counts the attempts. Under Lightning's
launcher the process the user started is rank 0, and nothing would start it again: with
``PipelineParallelStrategy(max_restarts=N)`` that process becomes a *supervisor* instead. It starts every local rank
(rank 0 too) by re-running the script, as torchrun's agent does, waits for them, and when one fails it ends the
others and starts them all again, at most ``N`` times; then it exits with their exit code (the script's code after
``trainer.fit`` runs in the ranks, as under torchrun). A restarted attempt's ``fit`` resumes from the run's newest
complete checkpoint (:mod:`lightning_pipe.reliability.launcher`).

The *run record* tells a restarted attempt where the first attempt's checkpoints went (a logger that numbers its
versions gives every attempt a new directory): global rank 0 records the directories of its ``ModelCheckpoint``
callbacks once they are resolved, in the torchrun agent's store (it outlives the workers) or in a file of the
supervisor's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, Optional

from lightning_pipe.reliability import recovery
from lightning_pipe.reliability.board import Board, describe_exit

#: Set by the supervisor for the ranks it starts: the attempt (0 for the first), its process id, the run record file.
RESTART_COUNT = "LIGHTNING_PIPE_RESTART_COUNT"
SUPERVISOR_PID = "LIGHTNING_PIPE_SUPERVISOR_PID"
RUN_RECORD = "LIGHTNING_PIPE_RUN_RECORD"
#: torchrun's count of restarts, and whether torchrun started this process.
_TORCHRUN_RESTARTS = "TORCHELASTIC_RESTART_COUNT"
#: Seconds the supervisor gives the other ranks to end by themselves after one failed (the failure board and the
#: watchdog end them within seconds), before it ends them.
END_WAIT = 30.0
#: The store key (outside the per-attempt keys of the failure board) of the run record under torchrun.
_STORE_KEY = "lightning_pipe/run/checkpoint_dirs"


def restart_count() -> int:
    """How many times this run's ranks were started again after a failure (0 in the first attempt)."""
    for name in (_TORCHRUN_RESTARTS, RESTART_COUNT):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def attempt_store(timeout: Optional[timedelta]) -> Any:
    """Under torchrun, from the second attempt on: the agent's store under a prefix of this attempt, to create the
    process group with; ``None`` otherwise (the default rendezvous is right).

    torchrun's agent keeps its store across restarts and the workers' default rendezvous uses it without a prefix
    (torch 2.13), so a restarted worker reads the previous attempt's addresses and fails to connect ("Gloo
    connectFullMesh failed ... Connection refused"; pytorch/pytorch#135712, #167288). ``--standalone`` happens not to
    share it.
    """
    import torch.distributed as dist

    if restart_count() == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timeout if timeout is not None else timedelta(minutes=30),
    )
    return dist.PrefixStore(f"lightning_pipe/attempt{restart_count()}", store)


def supervised_parent() -> Optional[int]:
    """The supervisor's process id when this process is a rank it started (and it is this process's parent)."""
    pid = os.environ.get(SUPERVISOR_PID, "")
    return int(pid) if pid.isdigit() and int(pid) == os.getppid() else None


# ---------------------------------------------------------------------------------------------------- run record
def record_checkpoint_dirs(dirs: Sequence[str], world_size: int) -> None:
    """Keep ``dirs`` (global rank 0, once they are resolved) for the attempts that follow; a no-op outside a restartable
    run."""
    dirs = sorted({str(Path(d).resolve()) for d in dirs})
    file = os.environ.get(RUN_RECORD)
    if file:
        known = _read_file(Path(file))
        Path(file).write_text(json.dumps(sorted(set(known) | set(dirs))))
        return
    if os.environ.get(_TORCHRUN_RESTARTS) is not None:
        board = Board.connect(world_size)
        if board is not None:
            try:
                known = json.loads(board.store.get(_STORE_KEY)) if board.store.check([_STORE_KEY]) else []
                board.store.set(_STORE_KEY, json.dumps(sorted(set(known) | set(dirs))))
            except (RuntimeError, ValueError):
                pass  # the run still saves; a restart then searches the directories it resolves itself


def recorded_checkpoint_dirs(world_size: int) -> list[str]:
    """The checkpoint directories earlier attempts of this run recorded."""
    file = os.environ.get(RUN_RECORD)
    if file:
        return _read_file(Path(file))
    if os.environ.get(_TORCHRUN_RESTARTS) is not None:
        board = Board.connect(world_size)
        if board is not None:
            try:
                return json.loads(board.store.get(_STORE_KEY)) if board.store.check([_STORE_KEY]) else []
            except (RuntimeError, ValueError):
                return []
    return []


def _read_file(file: Path) -> list[str]:
    try:
        return list(json.loads(file.read_text()))
    except (OSError, ValueError):
        return []


# ---------------------------------------------------------------------------------------------------- supervisor
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _say(message: str) -> None:
    print(f"lightning-pipe supervisor: {message}", file=sys.stderr, flush=True)


def supervise(
    command: Sequence[str],
    num_processes: int,
    max_restarts: int,
    environment: dict[str, str],
    in_place: bool = False,
    spares: int = 0,
) -> NoReturn:
    """Run ``command`` as local ranks ``0..num_processes-1`` of a one-node run, starting them all again after a
    failure at most ``max_restarts`` times; exit with their exit code. ``environment`` is the ranks' environment
    (``MASTER_ADDR`` included); each attempt gets a fresh ``MASTER_PORT``. With ``in_place`` (``snapshot_every``) a
    lost rank is first replaced alone, the others keeping their processes (:mod:`.recovery`), by one of ``spares``
    processes started with each attempt (a spare that took a place is followed by a new one once that recovery
    completed, so that ``spares`` stay waiting), else by a new one; each replacement counts as a restart."""
    record = Path(tempfile.mkdtemp(prefix="lightning-pipe-run-")) / "checkpoint_dirs.json"
    code, used, attempt = 1, 0, 0
    while True:
        env = {
            **environment,
            "MASTER_PORT": str(_free_port()),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(num_processes),
            RESTART_COUNT: str(attempt),
            SUPERVISOR_PID: str(os.getpid()),
            RUN_RECORD: str(record),
        }
        if in_place:
            file = record.parent / f"recovery{attempt}.json"
            recovery.announce(file, 0, int(env["MASTER_PORT"]), [])
            env.update({recovery.RECOVERY_FILE: str(file), recovery.GENERATION: "0"})
        procs = [subprocess.Popen(list(command), env={**env, "LOCAL_RANK": str(r)}) for r in range(num_processes)]
        if in_place:
            waiting = [_start_spare(command, env, num_processes, i) for i in range(spares)]
            try:
                code, first, replaced = _wait_in_place(procs, list(command), env, max_restarts - used, waiting)
            finally:
                _end([p for _, p in waiting], signal.SIGKILL)  # the spares not used
                for _, p in waiting:
                    p.wait()
            used += replaced
        else:
            code, first = _wait(procs)
        if code == 0:
            break
        how = describe_exit(first[1].pid, first[1].returncode).split(" without")[0]
        if used >= max_restarts:
            _say(f"rank {first[0]} failed ({how}); no restart left (max_restarts={max_restarts}), exiting.")
            break
        used, attempt = used + 1, attempt + 1
        _say(
            f"rank {first[0]} failed ({how}); starting every rank again (restart {used} of {max_restarts}),"
            " from the newest complete checkpoint."
        )
    sys.stdout.flush()
    sys.stderr.flush()
    # Not SystemExit: Lightning would take it for a failure of this process's Trainer (its `on_exception` hooks, an
    # OnExceptionCheckpoint saving an untrained model); this process ran nothing of the training.
    os._exit(code)


def _wait_in_place(
    procs: list[subprocess.Popen],
    command: list[str],
    env: dict[str, str],
    budget: int,
    spares: list[tuple[int, subprocess.Popen]],
) -> tuple[int, tuple[int, Any], int]:
    """Wait for the ranks, replacing a lost one in place (by a waiting spare of ``spares``, which it takes from the
    list, else a new process) while the others live, the last recovery completed and ``budget`` allows; else as
    :func:`_wait`. A spare that took a place is followed by a new one (appended to ``spares``) once its generation
    recovered, while ``budget`` allows another replacement. Returns its exit code and first failure, and the
    replacements made."""
    file, generation, used = Path(env[recovery.RECOVERY_FILE]), 0, 0
    replaced: list[int] = []
    next_spare, owed = len(spares), 0
    while True:
        if owed and used < budget and recovery.is_recovered(file, generation):
            # Not at once: on a busy node the new spare's start (imports, the model) would slow the recovery.
            spares.append(_start_spare(command, env, len(procs), next_spare))
            next_spare, owed = next_spare + 1, owed - 1
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return 0, (0, procs[0]), used
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        others_alive = all(c is None for r, c in enumerate(codes) if r not in bad)
        if len(bad) == 1 and others_alive and used < budget and recovery.is_recovered(file, generation):
            rank, how = bad[0], describe_exit(procs[bad[0]].pid, procs[bad[0]].returncode).split(" without")[0]
            generation, used, replaced = generation + 1, used + 1, [rank]
            port = _free_port()
            while spares and spares[0][1].poll() is not None:
                spares.pop(0)  # a spare that ended (it failed before waiting) takes no place
            by = "a new process"
            if spares:
                index, procs[rank] = spares.pop(0)
                by, owed = f"spare {index}", owed + 1
                recovery.announce(file, generation, port, replaced, spare=index)
            else:
                recovery.announce(file, generation, port, replaced)
            _say(
                f"rank {rank} failed ({how}); replacing it in place by {by} (generation {generation}, restart {used} of"
                f" {budget}): the other ranks keep their processes and resume from their snapshots in memory."
            )
            if by != "a new process":
                continue
            procs[rank] = subprocess.Popen(
                command,
                env={
                    **env,
                    "LOCAL_RANK": str(rank),
                    "MASTER_PORT": str(port),
                    recovery.GENERATION: str(generation),
                    recovery.REPLACES: str(generation),
                },
            )
            continue
        if bad:
            if not recovery.is_recovered(file, generation):
                _say(f"recovery in place (generation {generation}) failed; every rank starts again.")
                _end([procs[r] for r in replaced], signal.SIGKILL)  # a replacement holds no state yet
            recovery.fall_back(file)
            code, first = _wait(procs)
            return code, first, used
        time.sleep(0.05)


def _start_spare(
    command: Sequence[str], env: dict[str, str], num_processes: int, index: int
) -> tuple[int, subprocess.Popen]:
    """Hot spare ``index``: the script, run up to ``fit``, where it waits for a lost rank's place."""
    spare_env = {**env, "LOCAL_RANK": str(num_processes + index), recovery.SPARE: str(index)}
    return index, subprocess.Popen(list(command), env=spare_env)


def _wait(procs: list[subprocess.Popen]) -> tuple[int, tuple[int, Any]]:
    """Wait for the ranks; after the first failure give the others :data:`END_WAIT` seconds, then end them. Returns the
    exit code (0, or the first failure's) and ``(rank, process)`` of the first failure."""
    failed_at: Optional[float] = None
    first: tuple[int, Any] = (0, procs[0])
    try:
        while True:
            codes = [p.poll() for p in procs]
            if failed_at is None:
                bad = [(r, p) for r, (p, c) in enumerate(zip(procs, codes)) if c not in (None, 0)]
                if bad:
                    failed_at, first = time.monotonic(), bad[0]
            if all(c is not None for c in codes):
                break
            if failed_at is not None and time.monotonic() - failed_at > END_WAIT:
                _end(procs, signal.SIGKILL)
            time.sleep(0.2)
    except KeyboardInterrupt:
        _end(procs, signal.SIGINT)
        for p in procs:
            p.wait()
        raise
    if failed_at is None:
        return 0, first
    code = first[1].returncode
    return (code if code > 0 else 128 - code), first


def _end(procs: list[subprocess.Popen], signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)
