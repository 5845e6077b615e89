"""The launcher of ``PipelineParallelStrategy``: Lightning's script launcher with the watchdog's watches, every Trainer
entry run inside :func:`lightning_pipe.reliability.failures.entry`, restarts (:mod:`.restart`), and a restarted
``fit`` resumed from the newest complete checkpoint (docs/reliability.md)."""

from __future__ import annotations

import gc
import inspect
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

from typing_extensions import override

from lightning_pipe.compat.lightning import (
    SubprocessScriptLauncher,
    destroy_process_group,
    end_failed_entry,
    script_command,
    set_main_port,
    set_num_threads_if_needed,
    start_children,
)
from lightning_pipe.errors import PipelineConfigError, PipelinePeerFailure
from lightning_pipe.reliability import failures, recovery, restart, watchdog

#: Finds the checkpoint a restarted ``fit`` resumes from, given the Trainer (``None``: none is complete).
ResumeFinder = Callable[[Any], Optional[Path]]


@dataclass(frozen=True)
class InPlace:
    """What recovery in place needs from the strategy (``snapshot_every``): whether this rank holds a snapshot, and
    the ``ckpt_path`` under which ``fit`` resumes from the one the ranks agree on."""

    ready: Callable[[], bool]
    ckpt_path: str
    #: drops the strategy's references to the broken run's process groups (their connections close with the last)
    release: Callable[[], None] = lambda: None


class PipelineLauncher(SubprocessScriptLauncher):
    """Lightning's script launcher (rank 0 starts the other ranks of its node by re-running the script), with this
    package's watches instead of Lightning's child observer, and every Trainer entry run inside
    :func:`lightning_pipe.reliability.failures.entry`. Also used when the processes were started externally (torchrun,
    the supervisor of ``max_restarts``), where it starts nothing.

    With ``max_restarts > 0`` the process that would start the other ranks supervises instead (:func:`restart.
    supervise`); in a restarted attempt, ``fit(ckpt_path=None)`` resumes from what ``find_resume`` finds.
    """

    def __init__(
        self,
        cluster_environment: Any,
        num_processes: int,
        num_nodes: int,
        timeout: Optional[timedelta],
        max_restarts: int = 0,
        find_resume: Optional[ResumeFinder] = None,
        in_place: Optional[InPlace] = None,
        spares: int = 0,
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self._timeout = timeout
        self._max_restarts = max_restarts
        self._find_resume = find_resume
        #: as Lightning decides whether a strategy gets a launcher at all
        self._starts_processes = not cluster_environment.creates_processes_externally
        #: the checkpoint this process's restarted ``fit`` resumed from (``""``: none was found; ``None``: no restart)
        self.resumed_from: Optional[str] = None
        self._in_place = in_place
        self._spares = spares
        #: whether the running ``fit`` resumes from the snapshots in memory (a recovery in place)
        self.recovering = False

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return not self._starts_processes

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if self._starts_processes:
            # What Lightning's launcher does before calling the Trainer's function, with this package's watch instead
            # of its child observer (which SIGKILLs rank 0 five seconds after a child fails, often before rank 0
            # reported anything).
            self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
            if not self.cluster_environment.creates_processes_externally:
                if self._max_restarts > 0:
                    self._supervise()
                rank = self.cluster_environment.node_rank() * self.num_processes
                os.environ.update({failures.LAUNCHER_PID: str(os.getpid()), failures.LAUNCHER_RANK: str(rank)})
                start_children(self)
                watchdog.watch_children(self.procs, rank + 1, self._timeout)
            set_num_threads_if_needed(num_processes=self.num_processes)
        watchdog.start()
        if self._in_place is not None and recovery.is_spare() and _is_fit(trainer):
            recovery.await_assignment()  # a hot spare: imported and built, until a rank is lost
            set_main_port(self.cluster_environment, int(os.environ["MASTER_PORT"]))
        if self._in_place is not None and recovery.is_replacement() and _is_fit(trainer):
            args, kwargs = self._from_snapshot(function, args, kwargs)
        else:
            args, kwargs = self._resume_if_restarted(function, trainer, args, kwargs)
        while True:
            try:
                with failures.entry(trainer):
                    return function(*args, **kwargs)
            except Exception as err:
                if not self._recover_in_place(trainer, err):
                    raise
            gc.collect()  # the failed entry's frames (the exception's traceback) held groups too
            args, kwargs = self._from_snapshot(function, args, kwargs)

    def _recover_in_place(self, trainer: Any, err: Exception) -> bool:
        """A peer was lost during ``fit``: keep this process, wait for the supervisor's replacement and its new
        generation, end the failed entry and drop the broken process group; ``False`` when this rank cannot (no
        snapshot yet, no new generation): the error ends the process and the supervisor restarts every rank."""
        if self._in_place is None or not recovery.enabled() or not _is_fit(trainer):
            return False
        if not isinstance(err, PipelinePeerFailure) and not failures.is_broken_connection(err):
            return False  # this rank's own error: not a lost peer
        if not self._in_place.ready():
            _say("no snapshot in memory yet; every rank starts again from the newest checkpoint on disk.")
            return False
        found = recovery.await_generation(recovery.generation())
        if found is None:
            _say("the supervisor started no replacement; every rank starts again from the newest checkpoint on disk.")
            return False
        generation, port = found
        first_line = str(err).splitlines()[0][:200] if str(err) else ""
        _say(f"{type(err).__name__} ({first_line}); recovering in place (generation {generation}).")
        set_main_port(self.cluster_environment, port)
        end_failed_entry(trainer, err)
        self._in_place.release()
        destroy_process_group()
        recovery.enter(generation, port)
        failures.new_generation()
        return True

    def _from_snapshot(self, function: Callable, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """``fit`` resumes from the snapshot in memory that the ranks of this generation agree on."""
        assert self._in_place is not None
        self.recovering = True
        bound = inspect.signature(function).bind(*args, **kwargs)
        bound.arguments["ckpt_path"] = self._in_place.ckpt_path
        return bound.args, bound.kwargs

    def _supervise(self) -> None:
        if self.num_nodes > 1:
            raise PipelineConfigError(
                f"`max_restarts={self._max_restarts}` restarts the ranks of one node, but `num_nodes={self.num_nodes}`:"
                " the nodes' processes could not start again together. Launch with torchrun and pass"
                f" `--max-restarts={self._max_restarts}` to it (its agents coordinate the nodes), and leave"
                " `max_restarts` at 0."
            )
        environment = {
            **os.environ,
            "MASTER_ADDR": self.cluster_environment.main_address,
        }
        in_place = self._in_place is not None
        restart.supervise(script_command(), self.num_processes, self._max_restarts, environment, in_place, self._spares)

    def _resume_if_restarted(
        self, function: Callable, trainer: Any, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[tuple, dict[str, Any]]:
        """In a restarted attempt, ``fit`` without a ``ckpt_path`` resumes from the newest complete checkpoint (every
        rank finds the same one on the shared file system; the strategy checks that they agree)."""
        if restart.restart_count() == 0 or self._find_resume is None or not _is_fit(trainer):
            return args, kwargs
        try:
            bound = inspect.signature(function).bind(*args, **kwargs)
        except TypeError:
            return args, kwargs
        if bound.arguments.get("ckpt_path") is not None:
            return args, kwargs  # the script chose its checkpoint itself
        found = self._find_resume(trainer)
        self.resumed_from = "" if found is None else str(found)
        if found is not None:
            bound.arguments["ckpt_path"] = str(found)
        return bound.args, bound.kwargs


def _say(message: str) -> None:
    rank = os.environ.get("LOCAL_RANK", "?")
    print(f"lightning-pipe: rank {rank}: {message}", file=sys.stderr, flush=True)


def _is_fit(trainer: Any) -> bool:
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return getattr(fn, "value", fn) == "fit"
