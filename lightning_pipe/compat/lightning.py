"""Private Lightning names used by lightning-pipe (checked with Lightning 2.6).

Each is also used by Lightning's own strategies (``DDPStrategy``, ``ModelParallelStrategy``), which is why a strategy
outside Lightning can rely on it; they are imported here only, so an upgrade has one place to look.
"""

from __future__ import annotations

import sys

# Process-group set-up as `DDPStrategy.setup_distributed` does it; public replacement: none in Lightning 2.6.
from lightning.fabric.utilities.distributed import _distributed_is_initialized as distributed_is_initialized
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device as default_process_group_backend_for_device,
)
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection

# The thread count Lightning's launcher gives rank 0 (cpu_count // devices unless OMP_NUM_THREADS is set); the
# watchdog's launcher keeps it so that threads are as under Lightning's own. Public replacement: none.
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed as set_num_threads_if_needed

# `sync_dist` reduction of logged values across data-parallel replicas, as `DDPStrategy.reduce` does it.
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available

# Moving optimizer state to the device after `setup_optimizers`, as every Lightning strategy's `setup` does.
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device

# The launcher that re-runs the script once per local rank, as `DDPStrategy._configure_launcher` uses it; subclassed
# by `watchdog.PipelineLauncher` for its child spawning (`_call_children_scripts`), `kill` and `procs`.
# Public replacement: none (Lightning has no public launcher to subclass).
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)


def called_from_model_summary(depth: int = 8) -> bool:
    """Whether the current call comes from Lightning's ``ModelSummary`` forwarding ``example_input_array``.

    Detected by the name of Lightning's private ``ModelSummary._forward_example_input`` frame; no public hook tells a
    module that it is being summarised.
    """
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == "_forward_example_input":
            return True
        frame = frame.f_back
    return False


def set_device_mesh(lightning_module: object, mesh: object) -> None:
    """Expose ``mesh`` as ``LightningModule.device_mesh`` (a read-only property over ``_device_mesh``), as
    ``ModelParallelStrategy.setup_environment`` does, so ``configure_model`` can use it."""
    lightning_module._device_mesh = mesh  # type: ignore[attr-defined]


__all__ = [
    "SubprocessScriptLauncher",
    "called_from_model_summary",
    "default_process_group_backend_for_device",
    "distributed_is_initialized",
    "init_dist_connection",
    "optimizers_to_device",
    "set_device_mesh",
    "set_num_threads_if_needed",
    "sync_ddp_if_available",
]
