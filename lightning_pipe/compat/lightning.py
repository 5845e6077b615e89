"""Private Lightning names used by lightning-pipe (checked with Lightning 2.6).

Each is also used by Lightning's own strategies (``DDPStrategy``, ``ModelParallelStrategy``), which is why a strategy
outside Lightning can rely on it; they are imported here only, so an upgrade has one place to look.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Process-group set-up as `DDPStrategy.setup_distributed` does it; public replacement: none in Lightning 2.6.
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
# by `reliability.launcher.PipelineLauncher` for its `kill` and `procs`. Public replacement: none (Lightning has no
# public launcher to subclass).
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)

# Raised by Lightning's Tuner to end the trial `fit` of `lr_find`/`scale_batch_size`: control flow, not a failure.
from lightning.pytorch.utilities.exceptions import _TunerExitException as TunerExitException


def script_command() -> list[str]:
    """The command that runs this script again (``python script.py args`` or ``python -m module args``), as
    Lightning's launcher starts the other ranks (``_basic_subprocess_cmd``). Public replacement: none."""
    from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd

    return list(_basic_subprocess_cmd())


def training_dataloader_with(dataloader: Any, sampler: Any) -> Any:
    """A copy of the training ``DataLoader`` (of the user's class, made again from its constructor's arguments) that
    draws indices from ``sampler``: what Lightning does to add a ``DistributedSampler``
    (``lightning.pytorch.utilities.data._update_dataloader``). Public replacement: none."""
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)


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


def start_children(launcher: SubprocessScriptLauncher) -> None:
    """Start the other local ranks by re-running the script, as ``_SubprocessScriptLauncher.launch`` does before it
    calls the Trainer's function (``_call_children_scripts``: sets ``launcher.procs``). Public replacement: none."""
    launcher._call_children_scripts()


class LauncherHook:
    """Mixin for a strategy: Lightning asks a strategy for its launcher through the private ``_configure_launcher``
    (called by the accelerator connector; ``Strategy.launcher`` reads ``_launcher``). The strategy implements the
    public :meth:`make_launcher` instead. Public replacement: none in Lightning 2.6."""

    def make_launcher(self) -> Any:
        raise NotImplementedError

    def _configure_launcher(self) -> None:
        self._launcher = self.make_launcher()


def lightning_optimizers(strategy: Any) -> list[Any]:
    """The ``LightningOptimizer`` wrappers ``self.optimizers()`` returns, in ``configure_optimizers``' order."""
    return list(strategy._lightning_optimizers)


def set_device_mesh(lightning_module: object, mesh: object) -> None:
    """Expose ``mesh`` as ``LightningModule.device_mesh`` (a read-only property over ``_device_mesh``), as
    ``ModelParallelStrategy.setup_environment`` does, so ``configure_model`` can use it."""
    lightning_module._device_mesh = mesh  # type: ignore[attr-defined]


@contextmanager
def inside_fabric_backward() -> Iterator[None]:
    """Within the block, Fabric's hooks on the outputs of a set-up module let a backward pass through: a pipelined step
    runs its backward inside ``model.step`` (the schedule), not inside ``fabric.backward``, which Fabric checks through
    the private flag ``lightning.fabric.wrappers._in_fabric_backward``. Public replacement: none in Lightning 2.6."""
    from lightning.fabric import wrappers

    before = wrappers._in_fabric_backward
    wrappers._in_fabric_backward = True
    try:
        yield
    finally:
        wrappers._in_fabric_backward = before


def set_backward_sync_control(strategy: object, control: object) -> None:
    """Make ``control`` what ``fabric.no_backward_sync`` uses (Fabric reads the private
    ``Strategy._backward_sync_control``; Fabric's own strategies set it in ``__init__``). Public replacement: none."""
    strategy._backward_sync_control = control  # type: ignore[attr-defined]


__all__ = [
    "inside_fabric_backward",
    "set_backward_sync_control",
    "LauncherHook",
    "SubprocessScriptLauncher",
    "TunerExitException",
    "called_from_model_summary",
    "script_command",
    "training_dataloader_with",
    "default_process_group_backend_for_device",
    "init_dist_connection",
    "optimizers_to_device",
    "set_device_mesh",
    "set_num_threads_if_needed",
    "start_children",
    "sync_ddp_if_available",
]


def requested_weights_only(given: bool | None, depth: int = 12) -> bool | None:
    """The ``weights_only`` the user passed to ``trainer.fit``/``validate``/``test``/``predict``, where Lightning did
    not pass it on: a strategy that restores after setup (``restore_checkpoint_after_setup``, as FSDP and model
    parallelism do) gets ``None`` from Lightning 2.6's ``Trainer._run``, which keeps the argument for the restore
    before setup only. Read from that private frame; public replacement: none (fixed when Lightning passes it on).
    """
    if given is not None:
        return given
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name == "_run" and "weights_only" in frame.f_locals and "ckpt_path" in frame.f_locals:
            return frame.f_locals["weights_only"]
        frame = frame.f_back
    return None


def gradients_zeroed_after_step(trainer: Any) -> list[Any]:
    """The parameters whose gradients Lightning's automatic optimization sets to ``None`` right after the running
    ``training_step``, with nothing reading them in between; empty when that cannot be told.

    That is the case when an accumulation window starts (``_AutomaticOptimization._make_zero_grad_fn``: batch index
    divisible by ``accumulate_grad_batches``, backward not skipped), and neither the LightningModule nor a callback
    overrides ``on_before_zero_grad`` (which would read them), nor the module ``optimizer_zero_grad`` (whose default
    calls the one optimizer's ``zero_grad()``, ``set_to_none=True``). Private names read: ``fit_loop._skip_backward``
    (set by ``StochasticWeightAveraging``) and the epoch loop's ``batch_idx``, which is the index that loop passes to
    ``_make_zero_grad_fn``.
    """
    module, optimizers = trainer.lightning_module, trainer.optimizers
    if not module.automatic_optimization or len(optimizers) != 1 or trainer.fit_loop._skip_backward:
        return []
    if trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches != 0:
        return []
    callbacks = trainer.callbacks
    # A hook set on an instance counts as an override (its dict is read: cheap); the classes' are looked up once.
    # (Loops and lists, not generators: this runs at every step.)
    attributes = _attributes(module)
    if _BEFORE_ZERO_GRAD in attributes or _OPTIMIZER_ZERO_GRAD in attributes:
        return []
    for callback in callbacks:
        if _BEFORE_ZERO_GRAD in _attributes(callback):
            return []
    kind = type(module)
    hooks = (kind, getattr(kind, _BEFORE_ZERO_GRAD), getattr(kind, _OPTIMIZER_ZERO_GRAD))
    callback_hooks = tuple([(type(c), getattr(type(c), _BEFORE_ZERO_GRAD, None)) for c in callbacks])
    if _zero_grad_read_by(hooks, callback_hooks):
        return []
    return [p for group in optimizers[0].param_groups for p in group["params"]]


_BEFORE_ZERO_GRAD = "on_before_zero_grad"
_OPTIMIZER_ZERO_GRAD = "optimizer_zero_grad"


def _attributes(obj: Any) -> Any:
    return getattr(obj, "__dict__", ())


@functools.lru_cache(maxsize=64)
def _zero_grad_read_by(hooks: tuple[Any, ...], callback_hooks: tuple[tuple[type, Any], ...]) -> bool:
    """Whether the LightningModule class or a callback class overrides a hook that reads or replaces Lightning's
    ``zero_grad`` (:func:`gradients_zeroed_after_step`). Keyed by the classes and their hook functions, so that a
    hook assigned to a class later is seen."""
    from lightning.pytorch import Callback, LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if any(is_overridden(hook, hooks[0], LightningModule) for hook in (_BEFORE_ZERO_GRAD, _OPTIMIZER_ZERO_GRAD)):
        return True
    return any(is_overridden(_BEFORE_ZERO_GRAD, kind, Callback) for kind, _ in callback_hooks)


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """What ``trainer.save_checkpoint`` would write, as a dict (for an in-memory snapshot: no file is written).
    ``_CheckpointConnector.dump_checkpoint`` is private; ``trainer.save_checkpoint`` is its public form, but writes."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def end_failed_entry(trainer: Any, error: BaseException) -> None:
    """What Lightning does when a ``fit`` fails (``trainer.call._call_and_handle_interrupt``), for a ``fit`` that runs
    again in the same process (recovery in place): the strategy is told, the entry torn down; then the Trainer's
    state is set back as ``Trainer.fit`` sets it before its entry. The callbacks' ``on_exception`` hooks are not
    called (an ``OnExceptionCheckpoint`` would save); loggers are not finalized (the run goes on).
    ``Trainer._teardown`` is private; there is no public way to end an entry but its exception.

    A failure inside validation leaves the modules in eval mode (the evaluation loop sets their captured modes back
    only when it ends): they are set back here, from that capture (``_EvaluationLoop._module_mode``, private; the
    public ``on_validation_model_train`` hook is the user's), so that the ``fit`` run again trains with dropout. The
    values logged since the last reset (the loops' ``_results``, private; a new process has none) are dropped, as
    are the logger connector's metrics: the ``fit`` run again logs them from the snapshot's step as a resumed
    process would, not on top of the failed entry's partial validation. Each ``ModelCheckpoint`` forgets what it saved
    in this process (:func:`_as_new_checkpoint_callback`)."""
    from lightning.pytorch.trainer.states import TrainerStatus

    epoch_loop = trainer.fit_loop.epoch_loop
    if trainer.validating or trainer.sanity_checking:
        epoch_loop.val_loop._module_mode.restore(trainer.lightning_module)
    for results in (epoch_loop._results, epoch_loop.val_loop._results):
        results.reset()
    trainer._logger_connector.reset_metrics()
    for callback in trainer.checkpoint_callbacks:
        _as_new_checkpoint_callback(callback)
    trainer.strategy.on_exception(error)
    trainer._teardown()
    trainer.state.status = TrainerStatus.RUNNING
    trainer.training = True
    trainer.should_stop = False


def _as_new_checkpoint_callback(callback: Any) -> None:
    """Set back what a ``ModelCheckpoint`` keeps of its own saves outside its ``state_dict``
    (``_last_global_step_saved`` and two more, private; no public reset) to a new instance's values, as in a
    replacement process: a survivor that saved step 5 before a kill would skip the save of step 5 after resuming from
    an earlier snapshot while the replacement saves it, and their collectives (the save's barriers) would no longer
    match."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    if isinstance(callback, ModelCheckpoint):
        callback._last_global_step_saved = 0
        callback._last_checkpoint_saved = ""
        callback._last_time_checked = None


def set_main_port(cluster_environment: Any, port: int) -> None:
    """Point the cluster environment at a new rendezvous port: ``LightningEnvironment`` caches ``MASTER_PORT`` in
    ``_main_port`` on first read (no public setter), and the next process group must use the new one."""
    if hasattr(cluster_environment, "_main_port"):
        cluster_environment._main_port = port


def destroy_process_group() -> None:
    """Drop the default process group after a peer was lost (recovery in place), whatever state it is in."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except RuntimeError:
            pass  # a group whose peer is gone may fail to shut down cleanly; it is dropped either way
