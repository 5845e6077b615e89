"""The launcher of ``PipelineParallelStrategy``: Lightning's script launcher with the watchdog's watches, and every
Trainer entry run inside :func:`lightning_pipe.reliability.failures.entry` (docs/reliability.md)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable, Optional

from typing_extensions import override

from lightning_pipe.compat.lightning import SubprocessScriptLauncher, set_num_threads_if_needed, start_children
from lightning_pipe.reliability import failures, watchdog


class PipelineLauncher(SubprocessScriptLauncher):
    """Lightning's script launcher (rank 0 starts the other ranks of its node by re-running the script), with this
    module's watches instead of Lightning's child observer, and every Trainer entry run inside
    :func:`lightning_pipe.reliability.failures.entry`. Also used when the processes were started externally (torchrun),
    where it starts nothing."""

    def __init__(self, cluster_environment: Any, num_processes: int, num_nodes: int, timeout: Optional[timedelta]):
        super().__init__(cluster_environment, num_processes, num_nodes)
        self._timeout = timeout
        #: as Lightning decides whether a strategy gets a launcher at all
        self._starts_processes = not cluster_environment.creates_processes_externally

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return not self._starts_processes

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if self._starts_processes:
            # What Lightning's launcher does before calling the Trainer's function, with this module's watch instead
            # of its child observer (which SIGKILLs rank 0 five seconds after a child fails, often before rank 0
            # reported anything).
            self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
            if not self.cluster_environment.creates_processes_externally:
                rank = self.cluster_environment.node_rank() * self.num_processes
                os.environ.update({failures.LAUNCHER_PID: str(os.getpid()), failures.LAUNCHER_RANK: str(rank)})
                start_children(self)
                watchdog.watch_children(self.procs, rank + 1, self._timeout)
            set_num_threads_if_needed(num_processes=self.num_processes)
        watchdog.start()
        with failures.entry(trainer):
            return function(*args, **kwargs)
