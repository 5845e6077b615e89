"""The first failure of a multi-process run, recorded where every rank can read it and reported in place of the
broken connections it causes on the other ranks.

When one rank raises, its peers only see their connection to it break (gloo: "Connection closed by peer", NCCL: a
timeout), and that is what they would print. Here the failing rank writes its rank, pipeline stages, phase, message and
traceback to the run's rendezvous store (the c10d ``TCPStore`` that ``init_process_group`` already uses: hosted by rank
0 under Lightning's launcher, by the agent under torchrun) before its exception leaves the Trainer; the first writer
wins. A rank whose communication then fails raises :class:`~lightning_pipe.errors.PipelinePeerFailure` naming that rank
instead of the socket error. A rank killed before it could write (SIGKILL, the out-of-memory killer) is found by the
process id every rank registers once its stages are built. When the store itself is gone, the report says so.

On the success path this costs one store write per Trainer entry (``describe``), and the watchdog's read of the board
every 2 s (:mod:`lightning_pipe.reliability.watchdog`).
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from lightning_pipe.errors import PipelinePeerFailure
from lightning_pipe.reliability.board import Board, Failure, describe_exit, pid_alive, store_address

#: Seconds a rank whose connection broke waits for the failing rank's record before reporting what it knows.
REPORT_WAIT = 5.0
#: Seconds to wait, once a peer's process is found gone without a record, for its launcher to record how it ended.
DEAD_PEER_WAIT = 1.5
#: The environment variables under which Lightning's launcher (rank 0 of each node) tells the ranks it starts its
#: process id and global rank.
LAUNCHER_PID = "LIGHTNING_PIPE_LAUNCHER_PID"
LAUNCHER_RANK = "LIGHTNING_PIPE_LAUNCHER_RANK"
_TRACEBACK_CHARS = 12_000
FuncT = TypeVar("FuncT", bound=Callable[..., Any])
_PHASE_ATTR = "_lightning_pipe_phase"

# Exceptions that are control flow, an operator's decision, or a consequence of another rank's failure: not recorded.
_NOT_FAILURES = (KeyboardInterrupt, SystemExit, GeneratorExit, PipelinePeerFailure)  # DCP's error is a BaseException
# What gloo, NCCL and the c10d store say when the other end of a connection is gone or silent (never a bare "nccl" or
# "gloo": a rank's own misuse of a collective names its backend too, and is its own failure).
_BROKEN_CONNECTION = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "connection was likely closed",
    "remote process exited",  # NCCL: a peer died
    "communicator was aborted",  # NCCL: aborted after a peer's failure
    "ncclremoteerror",
)
# This rank could not open the store's port (taken by another process): its own failure, whatever the error's type.
_OWN_PORT = ("failed to listen on any local network address", "address already in use")
# A wait on a peer that ran out (gloo: "Timed out waiting 60000ms for recv operation", NCCL's watchdog: "collective
# operation timeout"): only with a word that names a transfer, not any error that mentions a timeout.
_TIMEOUT = ("timed out", "timeout")
_TRANSFER = ("recv", "send", "collective", "barrier", "allreduce", "all_reduce", "broadcast", "store")
_STAGE_PHASES = {
    "train": "during training",
    "sanity_check": "during the validation sanity check",
    "validate": "during validation",
    "test": "during testing",
    "predict": "during prediction",
}


# ------------------------------------------------------------------------------------------------- this process


@dataclass
class _Process:
    """What this process knows about itself; one process is one rank."""

    rank: Optional[int] = None
    stages: tuple[int, ...] = ()
    world_size: int = 1
    #: Trainer entries started so far in this process (every rank starts them in the same order)
    entry: int = 0
    #: the running entry (its index keys the board), its Trainer and phases; an inner entry (a Trainer in a callback,
    #: Lightning's Tuner) saves the outer one's and gives them back when it ends
    current: int = 0
    in_entry: bool = False
    trainer: Any = None
    phases: list[str] = field(default_factory=list)
    #: set when this process reported a failure (its own, recorded, or a peer's, raised): the watchdog stays quiet
    reported: Optional[float] = None
    board: Optional[Board] = None
    #: the other ranks' registrations (pid, host, stages), kept for when the store is gone
    peers: dict[int, dict[str, Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_PROCESS = _Process()


def _dist_rank_and_size() -> tuple[Optional[int], int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" in os.environ:
        return int(os.environ["RANK"]), world
    if os.environ.get("NODE_RANK", "0") == "0" and "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"]), world
    return None, world


def board() -> Optional[Board]:
    """This process's store client, connected on first use; ``None`` in a one-process run or without a store."""
    p = _PROCESS
    with p.lock:
        if p.board is not None and not p.board.reachable():
            p.board = None
        if p.board is None:
            rank, world = _dist_rank_and_size()
            p.rank = p.rank if p.rank is not None else rank
            p.world_size = max(p.world_size, world)
            p.board = Board.connect(p.world_size)
        return p.board


def describe(rank: int, stages: Sequence[int]) -> None:
    """Tell the other ranks who this process is (called once its stages are built)."""
    _PROCESS.rank, _PROCESS.stages = rank, tuple(stages)
    b = board()
    if b is not None:
        try:
            b.register(rank, stages)
        except (RuntimeError, ValueError):
            pass  # the store is gone: a peer failed already, and whoever reports it will say so


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Name what this rank is doing (``"while saving a checkpoint"``) for a report of a failure inside it."""
    _PROCESS.phases.append(name)
    try:
        yield
    except BaseException as err:
        if not hasattr(err, _PHASE_ATTR):  # the innermost phase names it; the record is written further out
            setattr(err, _PHASE_ATTR, name)
        raise
    finally:
        _PROCESS.phases.pop()


def in_phase(name: str) -> Callable[[FuncT], FuncT]:
    """Decorator form of :func:`phase`: the function runs in phase ``name``."""

    def decorate(fn: FuncT) -> FuncT:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with phase(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def current_phase() -> str:
    """The innermost named phase, else the Trainer's running stage, else start-up."""
    if _PROCESS.phases:
        return _PROCESS.phases[-1]
    stage = getattr(getattr(_PROCESS.trainer, "state", None), "stage", None)
    return _STAGE_PHASES.get(getattr(stage, "value", stage), "during start-up")


def this_rank() -> Optional[int]:
    """This process's global rank, as far as it is known yet (from the environment before the process group)."""
    return _PROCESS.rank if _PROCESS.rank is not None else _dist_rank_and_size()[0]


def in_entry() -> bool:
    return _PROCESS.in_entry


def entry_index() -> int:
    """The running Trainer entry's index (the last one started, between entries)."""
    return _PROCESS.current if _PROCESS.in_entry else _PROCESS.entry


def reported_at() -> Optional[float]:
    """When this process reported a failure (``time.monotonic()``), or ``None``."""
    return _PROCESS.reported


@contextmanager
def entry(trainer: Any = None) -> Iterator[None]:
    """Around one Trainer entry (``fit``, ``validate``, ...): record this rank's own failure for the others, and
    raise a peer's failure instead of the broken connection it caused here."""
    p = _PROCESS
    outer = (p.current, p.in_entry, p.trainer, p.phases, p.reported)
    p.entry += 1
    p.current, p.in_entry, p.trainer, p.phases, p.reported = p.entry, True, trainer, [], None
    failed: Optional[float] = None
    try:
        yield
    except BaseException as err:
        failed = p.reported = time.monotonic()
        _reraise(err)
    finally:
        p.current, p.in_entry, p.trainer, p.phases, p.reported = outer
        if failed is not None and not p.in_entry:
            # The process is on its way out with this failure: the watchdog stays quiet meanwhile. (An outer entry
            # that the exception leaves too records its own time; one that catches it keeps running as before.)
            p.reported = failed


def _reraise(err: BaseException) -> None:
    """Re-raise ``err``, or a :class:`PipelinePeerFailure` naming the rank that failed first when ``err`` is only this
    rank's view of it. Must be called while handling ``err``."""
    if isinstance(err, _NOT_FAILURES) or isinstance(err, _control_flow()):
        raise err
    failed = _checkpoint_failure_ranks(err)
    if (failed is None and not is_broken_connection(err)) or (failed is not None and _PROCESS.rank in failed):
        record(err)
        raise err
    here = _first_sentence(err) if failed is None else f"a checkpoint save failed on rank(s) {sorted(failed)}"
    first, store_gone = find_first_failure()
    if first is not None and first.rank != _PROCESS.rank:
        traceback_note = f"; rank {first.rank}'s traceback is in its output and below" if first.traceback else ""
        failure = PipelinePeerFailure(
            f"{first.sentence()}. This rank saw only the consequence ({here}){traceback_note}."
        )
        _attach(failure, first)
        _write_torchelastic_error_file(failure, first.traceback)
        raise failure from None
    if store_gone:
        raise PipelinePeerFailure(
            f"A peer rank ended while this rank was communicating with it ({here}), and the run's rendezvous store at"
            f" {_address_text()} is gone too, so which rank failed first"
            " is unknown: the process that hosted the store ended (rank 0 under Lightning's launcher, the agent under"
            " torchrun). Look for the first error in the other ranks' output."
        ) from None
    raise err


def _control_flow() -> tuple[type[BaseException], ...]:
    """Exceptions Lightning raises as control flow (the Tuner's trial end, a SIGTERM it handles): not failures."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_pipe.compat.lightning import TunerExitException

    return (TunerExitException, SIGTERMException)


def _address_text() -> str:
    address = store_address()
    return f"{address[0]}:{address[1]}" if address else "MASTER_ADDR:MASTER_PORT"


def _attach(failure: PipelinePeerFailure, first: Failure) -> None:
    failure.first_failure = first  # type: ignore[attr-defined]
    if first.traceback:
        note = f"--- rank {first.rank}'s traceback ---\n{first.traceback.rstrip()}"
        if hasattr(failure, "add_note"):  # Python >= 3.11
            failure.add_note(note)
        else:  # pragma: no cover
            failure.args = (f"{failure.args[0]}\n{note}",)


def _summary(err: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_sentence(err: BaseException) -> str:
    """``RuntimeError: Connection closed by peer [127.0.0.1]:9644`` of gloo's longer message."""
    text = " ".join(str(err).split())
    text = re.sub(r"^\[[^\]]*:\d+\] ", "", text)  # the native source location, [file.cc:553]
    text = f"{type(err).__name__}: {text.split('. ')[0].rstrip('.')}"
    return text if len(text) <= 200 else text[:197] + "..."


def _checkpoint_failure_ranks(err: BaseException) -> Optional[set[int]]:
    """The ranks that failed when ``err`` is torch.distributed.checkpoint's ``CheckpointException``, which every rank
    raises after the save gathered the failures (a rank not among them only sees a peer's failure)."""
    failures = getattr(err, "failures", None)
    return set(failures) if type(err).__name__ == "CheckpointException" and isinstance(failures, dict) else None


def _own_error(err: BaseException) -> BaseException:
    """What this rank itself raised: unwrapped from torch's pipelining and checkpoint wrappers."""
    failures = getattr(err, "failures", None)
    if _checkpoint_failure_ranks(err) and _PROCESS.rank in failures and isinstance(failures[_PROCESS.rank], tuple):
        return failures[_PROCESS.rank][0]  # (exception, stack summary)
    return _root_error(err)


def is_broken_connection(err: BaseException) -> bool:
    """Whether ``err`` is what a collective, a point-to-point transfer or the store raises when a peer is gone."""
    import torch.distributed as dist

    if isinstance(err, (dist.DistNetworkError, dist.DistStoreError)):
        # The connection to a peer or to the store broke; not this rank failing to open its own port.
        return not any(marker in str(err).lower() for marker in _OWN_PORT)
    if not isinstance(err, (RuntimeError, ConnectionError, TimeoutError)):  # DistBackendError is a RuntimeError
        return False
    text = str(err).lower()
    if any(marker in text for marker in _BROKEN_CONNECTION):
        return True
    return any(m in text for m in _TIMEOUT) and any(m in text for m in _TRANSFER)


def _root_error(err: BaseException) -> BaseException:
    """``err``, or what it wraps when torch's pipelining re-raised it (``[Stage 1] failed to run forward: ...``)."""
    while err.__cause__ is not None and err.__traceback__ is not None:
        frames = traceback.extract_tb(err.__traceback__)
        if not frames or "pipelining" not in Path(frames[-1].filename).parts:
            break
        err = err.__cause__
    return err


def failure_of(err: BaseException) -> Failure:
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    rank = _PROCESS.rank if _PROCESS.rank is not None else _dist_rank_and_size()[0]
    return Failure(
        rank=-1 if rank is None else rank,
        stages=_PROCESS.stages,
        phase=getattr(err, _PHASE_ATTR, None) or current_phase(),
        error=_summary(_own_error(err), limit=2000),
        traceback=text[-_TRACEBACK_CHARS:],
        pid=os.getpid(),
        host=socket.gethostname(),
    )


def record(err: BaseException) -> None:
    """Record this rank's own failure for the others (first writer wins), and for torchrun's agent."""
    failure = failure_of(err)
    b = board()
    if b is not None and failure.rank >= 0:
        try:
            b.record(entry_index(), failure)
        except (RuntimeError, ValueError):
            pass
    _write_torchelastic_error_file(err, failure.traceback)


def record_exit(rank: int, pid: int, returncode: Optional[int], stages: Sequence[int] = ()) -> Optional[Failure]:
    """Record, for a rank that died without writing a record, how it ended; returns the record that stands."""
    failure = Failure(rank, tuple(stages), "", describe_exit(pid, returncode), pid=pid)
    b = board()
    if b is None:
        return failure
    try:
        if not stages:
            failure = replace(failure, stages=tuple(b.registered().get(rank, {}).get("stages", ())))
        return b.record(entry_index(), failure)
    except (RuntimeError, ValueError):
        return failure


def new_generation() -> None:
    """This process joins a new process group after a recovery in place: the board and the peers' registrations are
    read again from the new rendezvous store (the lost rank's old process id is no longer a peer's)."""
    with _PROCESS.lock:
        _PROCESS.board, _PROCESS.peers = None, {}


def remember_peers() -> None:
    """Keep a copy of every rank's registration (until all have registered), for reports after the store is gone."""
    if _PROCESS.peers and len(_PROCESS.peers) >= _PROCESS.world_size:
        return
    b = board()
    if b is not None:
        try:
            _PROCESS.peers = b.registered()
        except (RuntimeError, ValueError):
            pass


def first_failure() -> Optional[Failure]:
    """The failure recorded first in the current Trainer entry, if any (``None`` also when the store is gone)."""
    b = board()
    if b is None:
        return None
    try:
        return b.first(entry_index())
    except (RuntimeError, ValueError):
        return None


def find_first_failure(wait: float = REPORT_WAIT) -> tuple[Optional[Failure], bool]:
    """The first failure, waiting up to ``wait`` seconds for it to be recorded; a registered peer found dead meanwhile
    is recorded as the first failure. Returns ``(failure or None, whether the store is gone)``."""
    start = time.monotonic()
    deadline = start + wait
    dead_since: Optional[float] = None
    while True:
        b = board()
        try:
            dead = _dead_peers(b)  # before reading: a rank that raised wrote its record before it died
            first = b.first(entry_index()) if b is not None else None
        except (RuntimeError, ValueError):
            b, dead, first = None, _dead_peers(None), None
        if first is not None:
            return first, False
        if dead:
            dead_since = dead_since or time.monotonic()
            # Lightning's launcher (our watch in rank 0) records a dead child's exit code within a second; torchrun's
            # agent records nothing here, and ends this process soon: report at once.
            launcher_records = os.environ.get(LAUNCHER_PID) is not None
            if b is None or not launcher_records or time.monotonic() - dead_since >= DEAD_PEER_WAIT:
                rank, info = dead[0]
                return record_exit(rank, info["pid"], None, info.get("stages", ())), b is None
        store_gone = b is None and store_address() is not None
        # A rank killed a moment ago may still be exiting (its sockets closed, its process not yet gone): look again.
        if (store_gone and time.monotonic() - start >= DEAD_PEER_WAIT) or time.monotonic() >= deadline:
            return None, store_gone
        try:
            time.sleep(0.2)
        except Exception:  # Lightning's SIGTERM handler runs here and tries a collective, which fails
            pass


def _dead_peers(b: Optional[Board]) -> list[tuple[int, dict[str, Any]]]:
    """Registered ranks on this host whose process is gone; without a store, Lightning's launcher if it is gone."""
    host = socket.gethostname()
    registered = b.registered() if b is not None else dict(_PROCESS.peers)
    launcher, launcher_rank = os.environ.get(LAUNCHER_PID), int(os.environ.get(LAUNCHER_RANK, "0"))
    if launcher and int(launcher) != os.getpid() and launcher_rank not in registered:
        registered[launcher_rank] = {"pid": int(launcher), "host": host, "stages": []}
    return [
        (r, info)
        for r, info in sorted(registered.items())
        if r != _PROCESS.rank and info.get("host") == host and not pid_alive(int(info["pid"]))
    ]


def _write_torchelastic_error_file(err: BaseException, stack: str) -> None:
    """Under torchrun, leave the exception where the agent looks for it (the format of torch's ``ErrorHandler``), so
    its failure summary shows the message instead of ``error_file: <N/A>``."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    data = {
        "message": {
            "message": f"{type(err).__name__}: {err}",
            "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))},
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass
