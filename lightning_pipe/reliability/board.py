"""Where a run's failures are recorded: the rendezvous store every rank already shares.

A :class:`Failure` is what the first failing rank leaves for the others (or what was found out about a rank that died
without a word); :class:`Board` keeps it, and every rank's process id, in the c10d ``TCPStore`` at
``MASTER_ADDR:MASTER_PORT`` (hosted by rank 0 under Lightning's launcher, by the agent under torchrun), through a
client of its own. Used by :mod:`lightning_pipe.reliability.failures`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Optional

#: Seconds to connect to the store (a plain socket probe first, so a store that is gone fails at once and quietly).
CONNECT_TIMEOUT = 3.0


@dataclass(frozen=True)
class Failure:
    """What the first failing rank recorded (or what was found out about a rank that died without recording)."""

    rank: int
    stages: tuple[int, ...]
    phase: str
    error: str
    traceback: str = ""
    pid: int = 0
    host: str = ""

    @property
    def where(self) -> str:
        """``rank 1 (pipeline stage 1)``; the stages are unknown before the pipeline is built."""
        if not self.stages:
            return f"rank {self.rank}"
        if len(self.stages) == 1:
            return f"rank {self.rank} (pipeline stage {self.stages[0]})"
        return f"rank {self.rank} (pipeline stages {', '.join(map(str, self.stages[:-1]))} and {self.stages[-1]})"

    def sentence(self) -> str:
        """One line for reports: who failed first, when, and with what."""
        phase = f", {self.phase}" if self.phase else ""
        return f"{self.where[0].upper()}{self.where[1:]} failed first{phase}: {self.error}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> Failure:
        data = json.loads(text)
        return cls(**{**data, "stages": tuple(data.get("stages", ()))})


def describe_exit(pid: int, returncode: Optional[int]) -> str:
    """How a process that wrote no record ended: killed by a signal, an exit code, or just gone (``None``)."""
    if returncode is None:
        how = "ended"
    elif returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        how = f"was killed by {name}"
    else:
        how = f"exited with code {returncode}"
    return (
        f"its process (pid {pid}) {how} without reporting a Python exception (killed by hand or by a scheduler, out"
        " of memory, or a crash in native code)"
    )


class Board:
    """Failure records and process ids in the run's TCPStore, under keys of their own.

    Keys carry torchrun's restart count, so an elastic restart does not read the previous attempt's failure, and the
    index of the Trainer entry (``fit``, ``validate``, ...), so an error that every rank raised and a script caught in
    one entry is not taken for a failure of the next.
    """

    def __init__(self, store: Any, address: tuple[str, int], world_size: int) -> None:
        self.store = store
        self.address = address
        self.world_size = world_size
        self.prefix = f"lightning_pipe/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def reachable(self) -> bool:
        """Whether the store still accepts connections (checked before each use: a request to a store that is gone
        fails too, but only after c10d logged the broken socket with a native stack trace)."""
        return _accepts(self.address)

    @classmethod
    def connect(cls, world_size: int) -> Optional[Board]:
        """A client of the store at ``MASTER_ADDR:MASTER_PORT``, or ``None`` when there is none (yet, or any more)."""
        import torch.distributed as dist

        address = store_address()
        # A refused probe costs nothing; a TCPStore client to a dead address would retry and log each attempt.
        if address is None or world_size < 2 or not _accepts(address):
            return None
        try:
            store = dist.TCPStore(
                *address, is_master=False, timeout=timedelta(seconds=CONNECT_TIMEOUT), wait_for_workers=False
            )
        except (RuntimeError, ValueError):
            return None
        return cls(store, address, world_size)

    def _key(self, entry: int) -> str:
        return f"{self.prefix}/entry{entry}/first"

    def record(self, entry: int, failure: Failure) -> Failure:
        """Record ``failure`` unless one is recorded already; returns the one that stands."""
        stored = self.store.compare_set(self._key(entry), "", failure.to_json())
        return Failure.from_json(stored)

    def first(self, entry: int) -> Optional[Failure]:
        key = self._key(entry)
        return Failure.from_json(self.store.get(key)) if self.store.check([key]) else None

    def register(self, rank: int, stages: Sequence[int]) -> None:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "stages": list(stages)}
        self.store.set(f"{self.prefix}/rank{rank}", json.dumps(info))

    def registered(self) -> dict[int, dict[str, Any]]:
        keys = {r: f"{self.prefix}/rank{r}" for r in range(self.world_size)}
        return {r: json.loads(self.store.get(k)) for r, k in keys.items() if self.store.check([k])}


def store_address() -> Optional[tuple[str, int]]:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return (host, int(port)) if host and port and port.isdigit() else None


def _accepts(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=CONNECT_TIMEOUT).close()
    except OSError:
        return False
    return True


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
