"""The strategy's checkpoint hooks: what Lightning's ``save_checkpoint``, ``load_checkpoint`` and the state-dict hooks
do under a pipeline, on each rank.

:class:`CheckpointHooks` is a mixin of ``PipelineParallelStrategy``: it uses the public ``Strategy`` API
(``broadcast``, ``lightning_module``, ``model``, ``optimizers``, ``is_global_zero``) and the strategy's
:meth:`CheckpointHooks.checkpoint_topology` (where this process sits, which stages it holds, the aliases of tied
parameters).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

from torch import nn
from typing_extensions import override

from lightning_pipe.checkpoint import huggingface as hf
from lightning_pipe.checkpoint import io, optim
from lightning_pipe.reliability import failures


class CheckpointHooks:
    """Checkpoints as directories of per-rank ``torch.distributed.checkpoint`` shards (docs/checkpoints.md)."""

    def checkpoint_topology(self) -> io.Topology:
        """Where this process sits, as the checkpoint code needs it (implemented by the strategy)."""
        raise NotImplementedError

    def checkpoint_network(self) -> tuple[str, Optional[nn.Module]]:
        """The LightningModule's attribute holding the pipelined network (``""``: the module itself) and the network
        (``None`` before the split; implemented by the strategy)."""
        raise NotImplementedError

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
        return io.model_state(self.model, self.checkpoint_topology().aliases)  # type: ignore[attr-defined]

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's optimizer state, flattened and keyed by parameter name."""
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the torch one
        return io.optimizer_state(self.model, optimizer, self.checkpoint_topology().aliases)  # type: ignore[attr-defined]

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
        path, token = self.broadcast((Path(filepath), uuid.uuid4().hex[:12]))  # type: ignore[attr-defined]
        module = self.lightning_module  # type: ignore[attr-defined]
        cls = type(module)
        groups = optim.recorded_param_groups(module)
        attribute, network = self.checkpoint_network()
        record = hf.network_record(network, attribute) if network is not None else None
        topology = self.checkpoint_topology()
        io.save(checkpoint, path, topology, token, f"{cls.__module__}.{cls.__qualname__}", groups, record)

    @override
    def load_checkpoint(self, checkpoint_path: Union[str, Path], weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a directory checkpoint or a single-device ``.ckpt`` into this rank's stages (model, and optimizers
        when fitting); returns Lightning's remaining checkpoint state."""
        from lightning.pytorch.trainer.states import TrainerFn

        module, path = self.lightning_module, Path(self.broadcast(checkpoint_path))  # type: ignore[attr-defined]
        model, optimizers, topology = self.model, self.optimizers, self.checkpoint_topology()  # type: ignore[attr-defined]
        strict = module.strict_loading
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        if not fitting and hf.is_hf_directory(path):
            from lightning.pytorch import __version__

            prefix = self.checkpoint_network()[0]
            precision = self.precision_plugin.precision  # type: ignore[attr-defined]
            prefix = f"{prefix}." if prefix else ""
            io.load_weights(path, topology, model, network_prefix=prefix, strict=strict, precision=precision)
            return {"pytorch-lightning_version": __version__}  # weights only: nothing else for Lightning to restore
        if path.is_dir() or not path.exists():
            return io.load(
                path, topology, model, optimizers if fitting else [], strict=strict, weights_only=weights_only
            )
        if fitting:
            groups = optim.recorded_param_groups(module)
            return io.resume_from_file(
                path, topology, model, optimizers, groups, strict=strict, weights_only=weights_only
            )
        return io.load_weights(path, topology, model, network_prefix="", strict=strict)

    @override
    def remove_checkpoint(self, filepath: Union[str, Path]) -> None:
        """Delete a checkpoint directory (or file) on global rank 0; never a save's temporary directory."""
        if self.is_global_zero:  # type: ignore[attr-defined]
            io.remove(Path(filepath), uuid.uuid4().hex[:12])
