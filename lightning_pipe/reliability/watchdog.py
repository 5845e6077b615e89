"""No rank outlives its run by more than a few seconds: a watchdog thread in every process, and Lightning's script
launcher with a watch on the ranks it starts.

The process-group timeout bounds each collective, but three waits escape it or make it the only way out:

- a rank whose launcher died (rank 0 under Lightning's launcher, the agent under torchrun) may be blocked connecting to
  the store that process hosted, or keep computing: the *parent-death watch* ends it;
- a rank blocked in a collective with live peers while another rank has failed (NCCL waits the whole timeout; a rank
  not connected to the failed one waits on its neighbours): the *failure-board watch* ends it once the failure is
  recorded and the rank has not reported it itself within :data:`GRACE` seconds;
- rank 0 under Lightning's launcher, when a rank it started dies: the watch of its children
  (:class:`~lightning_pipe.reliability.launcher.PipelineLauncher` starts it) records how it ended and
  ends the run after :data:`GRACE` seconds if rank 0 has not reported it itself; when rank 0's script ends it waits
  for its children (as torchrun's agent does) so that none is left running, and exits non-zero if one failed.

Every such exit prints one line to stderr and exits with :data:`EXIT_CODE`. See docs/reliability.md.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

from typing_extensions import override

from lightning_pipe.errors import PipelinePeerFailure
from lightning_pipe.reliability import failures, restart
from lightning_pipe.reliability.board import Failure, describe_exit, pid_alive

#: Seconds between two checks of the parent and the children.
POLL = 0.5
#: Seconds between two reads of the failure board (one store request per rank each time).
BOARD_POLL = 2.0
#: Seconds a rank gets to report a failure itself (its exception) before the watchdog reports it and ends the process.
GRACE = 5.0
#: Exit code of a process the watchdog ends.
EXIT_CODE = 1

_WATCH: Optional[_Watch] = None
_WATCH_LOCK = threading.Lock()
_JOIN_REGISTERED = False


def start() -> None:
    """Start this process's watchdog thread (once; later calls do nothing)."""
    global _WATCH
    with _WATCH_LOCK:
        if _WATCH is None:
            _WATCH = _Watch(_expected_parent())
            _WATCH.start()


def start_if_launched() -> None:
    """Start the watchdog now in a rank a launcher started (called when a ``PipelineParallelStrategy`` is made, not on
    import), so that a rank whose launcher dies while it loads data or builds its model does not go on until its first
    Trainer entry."""
    if _expected_parent() is not None:
        start()


def _expected_parent() -> Optional[int]:
    import torch.distributed as dist

    if dist.is_torchelastic_launched():
        return os.getppid()  # torchrun's agent
    supervisor = restart.supervised_parent()
    if supervisor is not None:
        return supervisor  # the supervisor of `max_restarts` (reliability.restart)
    launcher = os.environ.get(failures.LAUNCHER_PID)
    if not launcher or int(launcher) == os.getpid() or os.environ.get("LOCAL_RANK", "0") == "0":
        return None
    pid = int(launcher)
    if os.getppid() == pid or not pid_alive(pid):
        return pid  # our launcher, alive or already gone
    return None  # the variable was inherited from an unrelated ancestor


def _lightning_launcher() -> Optional[int]:
    pid = os.environ.get(failures.LAUNCHER_PID)
    return int(pid) if pid else None


def _say(message: str) -> None:
    rank = failures.this_rank()
    prefix = f"[rank{rank}]: " if rank is not None else ""
    print(f"{prefix}lightning-pipe: {message}", file=sys.stderr, flush=True)


def _exit(message: Optional[str], children: Callable[[], None] = lambda: None) -> None:
    if message:
        _say(message)
    children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE)


class _Watch(threading.Thread):
    def __init__(self, parent: Optional[int]) -> None:
        super().__init__(name="lightning-pipe-watchdog", daemon=True)
        self.parent = parent
        self.children: list[tuple[int, subprocess.Popen]] = []
        self.join_timeout: Optional[float] = None
        self.ending_children = False
        self._child_failed_at: Optional[float] = None
        self._peer_seen: Optional[tuple[int, float]] = None  # (entry, when)
        self._board_read_at = 0.0

    @override
    def run(self) -> None:
        while True:
            time.sleep(POLL)
            try:
                self._check_parent()
                self._check_children()
                self._check_board()
            except Exception:  # a watchdog that dies of its own error would leave the hang it is here to end
                logging.getLogger(__name__).debug("watchdog check failed", exc_info=True)

    def _end(self, message: str) -> None:
        reported = failures.reported_at()
        if reported is not None and time.monotonic() - reported < GRACE:
            return  # this rank reported already and is on its way out
        _exit(None if reported is not None else message, self.end_children)

    def _check_parent(self) -> None:
        if self.parent is None or os.getppid() == self.parent:
            return
        # Not the failure board: the launcher hosted the store, which is gone with it.
        if self.parent == _lightning_launcher():
            launcher = f"rank {os.environ.get(failures.LAUNCHER_RANK, '0')}"
        elif os.environ.get(restart.SUPERVISOR_PID) == str(self.parent):
            launcher = "the supervising process (max_restarts)"
        else:
            launcher = "torchrun's agent"
        self._end(
            f"{launcher} (pid {self.parent}), which launched this rank, ended; exiting with code {EXIT_CODE} instead"
            " of waiting for it until the timeout."
        )

    def _check_children(self) -> None:
        if self.ending_children:
            return
        failed = [(rank, proc) for rank, proc in self.children if proc.poll() not in (None, 0)]
        if not failed:
            return
        now = time.monotonic()
        if self._child_failed_at is None:
            self._child_failed_at = now
            for rank, proc in failed:  # what the other ranks will read if the rank wrote no record of its own
                failures.record_exit(rank, proc.pid, proc.returncode)
            return
        if now - self._child_failed_at >= GRACE:
            first = _first_failure_or(*failed[0])
            self._end(f"{first.sentence()}. Ending the run (the other ranks, then this one, exit code {EXIT_CODE}).")

    def _check_board(self) -> None:
        if not failures.in_entry() or failures.reported_at() is not None:
            self._peer_seen = None
            return
        failures.remember_peers()  # until every rank registered: a few requests after start-up
        now = time.monotonic()
        if now - self._board_read_at < BOARD_POLL:
            return
        self._board_read_at = now
        first = failures.first_failure()
        if first is None or first.rank == failures.this_rank():
            return
        entry = failures.entry_index()
        if self._peer_seen is None or self._peer_seen[0] != entry:
            self._peer_seen = (entry, now)
        elif now - self._peer_seen[1] >= GRACE:
            self._end(
                f"{first.sentence()}. This rank was still running ({failures.current_phase()}) {GRACE:.0f} s later,"
                f" blocked or unaware of it; exiting with code {EXIT_CODE}. Rank {first.rank}'s traceback is in its"
                " output."
            )

    def end_children(self, grace: float = GRACE) -> None:
        """End the children still running: SIGTERM, then SIGKILL after ``grace`` seconds (at once for 0)."""
        self.ending_children = True
        running = [proc for _, proc in self.children if proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM if grace > 0 else signal.SIGKILL)
        deadline = time.monotonic() + grace
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def join_children(self, timeout: Optional[float]) -> None:
        """At rank 0's exit: wait for the ranks it started, end those still running after ``timeout`` seconds, and
        exit non-zero if one failed (as torchrun's agent does). When rank 0 exits with an exception of its own, it
        failed first and its traceback is the report: the others are ended at once, instead of waiting for it."""
        if not self.children or self.ending_children:
            return
        crash = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if crash is not None and not isinstance(crash, PipelinePeerFailure):
            self.end_children(grace=0.0)
            return
        wait = GRACE if crash is not None else timeout
        deadline = None if wait is None else time.monotonic() + wait
        for rank, proc in self.children:
            try:
                proc.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if crash is None:
                    _say(f"rank {rank} (pid {proc.pid}) still ran {wait:.0f} s after rank 0 finished; ending it.")
        failed = [(rank, proc) for rank, proc in self.children if proc.poll() not in (None, 0)]
        self.end_children()
        if crash is not None or not failed:
            return
        rank, proc = failed[0]
        first = _first_failure_or(rank, proc)
        _exit(f"{first.sentence()}. Exiting with code {EXIT_CODE}.")


def _first_failure_or(rank: int, proc: subprocess.Popen) -> Failure:
    """The recorded first failure, else how the child ``proc`` (global rank ``rank``) ended."""
    recorded = failures.first_failure()
    return recorded or Failure(rank, (), "", describe_exit(proc.pid, proc.returncode))


def watch_children(procs: list[subprocess.Popen], first_rank: int, timeout: Optional[timedelta]) -> None:
    """Watch the ranks Lightning's launcher started (global ranks ``first_rank``, ``first_rank + 1``, ...)."""
    global _JOIN_REGISTERED
    start()
    assert _WATCH is not None
    _WATCH.children = [(first_rank + i, proc) for i, proc in enumerate(procs)]
    _WATCH.join_timeout = None if timeout is None else timeout.total_seconds()
    with _WATCH_LOCK:
        if not _JOIN_REGISTERED:  # once per process, however many launches: it joins the children of the last one
            atexit.register(_join_children_at_exit)
            _JOIN_REGISTERED = True


def _join_children_at_exit() -> None:
    if _WATCH is not None:
        _WATCH.join_children(_WATCH.join_timeout)
