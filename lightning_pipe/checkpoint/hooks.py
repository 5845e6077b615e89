"""The strategy's checkpoint hooks: what Lightning's ``save_checkpoint``, ``load_checkpoint`` and the state-dict hooks
do under a pipeline, on each rank.

:class:`CheckpointHooks` is a mixin of ``PipelineParallelStrategy``: it uses the public ``Strategy`` API
(``broadcast``, ``lightning_module``, ``model``, ``optimizers``, ``is_global_zero``) and the strategy's
:meth:`CheckpointHooks.checkpoint_topology` (where this process sits, which stages it holds, the aliases of tied
parameters). Per Trainer entry the strategy opens a :class:`~lightning_pipe.checkpoint.resume.CheckpointSession`
(:meth:`CheckpointHooks.open_checkpoints`) and closes it at teardown (:meth:`CheckpointHooks.close_checkpoints`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

from lightning.pytorch.strategies import Strategy
from torch import nn
from typing_extensions import override

from lightning_pipe.checkpoint import fabric_state, hparams, io, optim, resume, save, snapshot
from lightning_pipe.compat.lightning import requested_weights_only
from lightning_pipe.models import kind_of
from lightning_pipe.reliability import failures


class CheckpointHooks(Strategy):
    """Checkpoints as directories of per-rank ``torch.distributed.checkpoint`` shards (docs/checkpoints.md)."""

    _checkpoints: Optional[resume.CheckpointSession] = None
    _write_group: Optional[tuple[Any, Any]] = None
    _streams: Any = None
    _snapshots: Optional[snapshot.Snapshots] = None

    def checkpoint_topology(self) -> io.Topology:
        """Where this process sits, as the checkpoint code needs it (implemented by the strategy)."""
        raise NotImplementedError

    def checkpoint_network(self) -> tuple[str, Optional[nn.Module]]:
        """The LightningModule's attribute holding the pipelined network (``""``: the module itself) and the network
        (``None`` before the split; implemented by the strategy)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ one Trainer entry
    def open_checkpoints(self, trainer: Any, streams: Any, asynchronous: bool, resumed_from: Optional[str]) -> None:
        """Start this entry's checkpoint session (collective, in ``setup``): ``streams`` are the random streams a
        resume point keeps; ``resumed_from`` is where the launcher resumed a restarted ``fit`` (checked to be the
        same on every rank)."""
        from lightning_pipe.comm import collectives

        topology = self.checkpoint_topology()
        group = None
        if asynchronous:
            world = collectives.world_group()
            if self._write_group is None or self._write_group[0] is not world:  # one per process group
                self._write_group = (world, resume.write_group(resume.writer_ranks(topology)))
            group = self._write_group[1]
        device = self.root_device
        self._streams = streams
        self._checkpoints = resume.CheckpointSession(trainer, self.checkpoint_topology, streams, device, group)
        if resumed_from is not None:
            resume.check_same_resume(resumed_from)
        resume.record_run(trainer, topology.world_size, topology.global_rank)

    def close_checkpoints(self) -> None:
        """End of the entry (teardown): pending saves complete, or are dropped after a failure."""
        session, self._checkpoints = self._checkpoints, None
        if session is not None:
            session.finish()

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """A training loader gets its stand-in (:mod:`lightning_pipe.reliability.loaders`): exact mid-epoch resume."""
        return self._checkpoints.stand_in(dataloader) if self._checkpoints is not None else dataloader

    @override
    def on_train_end(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.end_of_training()

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._checkpoints is not None:
            self._checkpoints.failed = True  # no collective may run any more: pending saves are dropped

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # A rank holds only its stages, which exist only after the split in `setup`.
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        # `load_checkpoint` restores the optimizers itself (by parameter name, whatever the layout at save time).
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's stages' entries, under the full model's names."""
        return io.model_state(self.model, self.checkpoint_topology().aliases)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's optimizer state, flattened and keyed by parameter name."""
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the torch one
        return io.optimizer_state(self.model, optimizer, self.checkpoint_topology().aliases)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # `load_checkpoint` already loaded this rank's weights

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # `load_checkpoint` already loaded this rank's optimizer states

    @override
    @failures.in_phase("while saving a checkpoint")
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Union[str, Path], storage_options: Optional[Any] = None
    ) -> None:
        """Save ``checkpoint`` as the directory ``filepath`` (atomically; see docs/checkpoints.md)."""
        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported: checkpoints are"
                " written with torch.distributed.checkpoint, not a CheckpointIO plugin. Remove `storage_options`."
            )
        path, token = self.broadcast((Path(filepath), uuid.uuid4().hex[:12]))
        module = self.lightning_module
        cls = type(module)
        groups = optim.recorded_param_groups(module)
        session = self._checkpoints
        if session is None:  # between Trainer entries (`trainer.save_checkpoint` after `fit`): written at once
            device = self.root_device
            session = resume.CheckpointSession(module.trainer, self.checkpoint_topology, self._streams, device)
            session.training_over = True
        hparams.for_checkpoint(module, checkpoint)  # the networks kept by `save_hyperparameters()` as built
        attribute, network = self.checkpoint_network()
        record = kind_of(network).record(network, attribute) if network is not None else None  # for export-hf
        session.save(checkpoint, path, token, f"{cls.__module__}.{cls.__qualname__}", groups, record)

    @override
    def load_checkpoint(self, checkpoint_path: Union[str, Path], weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a directory checkpoint or a single-device ``.ckpt`` into this rank's stages (model, and optimizers
        when fitting); returns Lightning's remaining checkpoint state."""
        from lightning.pytorch.trainer.states import TrainerFn

        weights_only = requested_weights_only(weights_only)
        module, path = self.lightning_module, Path(self.broadcast(checkpoint_path))
        model, optimizers, topology = self.model, self.optimizers, self.checkpoint_topology()
        strict = module.strict_loading
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        if self._checkpoints is not None:
            self._checkpoints.writer.finish(None)  # a checkpoint being written is complete before any load
        if str(checkpoint_path) == snapshot.MEMORY and self._snapshots is not None and fitting:
            return self._load_snapshot(topology)
        if not fitting and io.pretrained_files(path) is not None:
            from lightning.pytorch import __version__

            prefix = self.checkpoint_network()[0]
            precision = self.precision_plugin.precision
            prefix = f"{prefix}." if prefix else ""
            io.load_weights(path, topology, model, network_prefix=prefix, strict=strict, precision=precision)
            return {"pytorch-lightning_version": __version__}  # weights only: nothing else for Lightning to restore
        if path.is_dir() or not path.exists():
            rest = io.load(
                path, topology, model, optimizers if fitting else [], strict=strict, weights_only=weights_only
            )
            point = rest.pop(io.RESUME_POINT, None)
            if fabric_state.MODEL_KEY in rest:
                point = None  # `fabric.save` keeps no random streams of the Trainer's
            if fitting and self._checkpoints is not None:
                self._checkpoints.resume_from(point, path)
            schedulers = len(self.lr_scheduler_configs) if fitting else 0
            return fabric_state.as_trainer_checkpoint(rest, path, schedulers)
        if fitting:
            groups = optim.recorded_param_groups(module)
            return io.resume_from_file(
                path, topology, model, optimizers, groups, strict=strict, weights_only=weights_only
            )
        return io.load_weights(path, topology, model, network_prefix="", strict=strict)

    def _load_snapshot(self, topology: io.Topology) -> dict[str, Any]:
        """Recovery in place: the agreed in-memory snapshot into this rank's stages and optimizers; no file is read."""
        assert self._snapshots is not None
        checkpoint, point = self._snapshots.restore()
        io.load_in_memory(checkpoint, topology, self.model, self.optimizers)
        if self._checkpoints is not None:
            self._checkpoints.resume_from(point, Path(snapshot.MEMORY))
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: Union[str, Path]) -> None:
        """Delete a checkpoint directory (or file) on global rank 0; never a save's temporary directory."""
        if self.is_global_zero:
            token = uuid.uuid4().hex[:12]
            if self._checkpoints is not None:  # held back until every newer save is committed
                self._checkpoints.writer.remove(Path(filepath), token)
            else:
                save.remove(Path(filepath), token)
