"""The launcher of ``PipelineParallelStrategy``: Lightning's script launcher with the watchdog's watches, every Trainer
entry run inside :func:`lightning_pipe.reliability.failures.entry`, restarts (:mod:`.restart`), and a restarted
``fit`` resumed from the newest complete checkpoint (docs/reliability.md)."""

from __future__ import annotations

import inspect
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

from typing_extensions import override

from lightning_pipe.compat.lightning import (
    SubprocessScriptLauncher,
    script_command,
    set_num_threads_if_needed,
    start_children,
)
from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.reliability import failures, restart, watchdog

#: Finds the checkpoint a restarted ``fit`` resumes from, given the Trainer (``None``: none is complete).
ResumeFinder = Callable[[Any], Optional[Path]]


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
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self._timeout = timeout
        self._max_restarts = max_restarts
        self._find_resume = find_resume
        #: as Lightning decides whether a strategy gets a launcher at all
        self._starts_processes = not cluster_environment.creates_processes_externally
        #: the checkpoint this process's restarted ``fit`` resumed from (``""``: none was found; ``None``: no restart)
        self.resumed_from: Optional[str] = None

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
        args, kwargs = self._resume_if_restarted(function, trainer, args, kwargs)
        with failures.entry(trainer):
            return function(*args, **kwargs)

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
        restart.supervise(script_command(), self.num_processes, self._max_restarts, environment)

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


def _is_fit(trainer: Any) -> bool:
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return getattr(fn, "value", fn) == "fit"
