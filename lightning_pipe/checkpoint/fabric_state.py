"""``fabric.save(path, state)`` and ``fabric.load(path, state)`` in the strategy's checkpoint format.

A Fabric ``state`` dict (the set-up model, its optimizers, any other values) becomes the checkpoint the Trainer's
strategy writes: the model's entries under ``state_dict`` and each optimizer's under ``optimizer_<i>``, per-rank
``torch.distributed.checkpoint`` shards under the full model's names (each rank writes and reads only its own
stages, whatever the layout at save time); the other values go with the trainer state (``state_dict()`` of an object
that has one), and the state's keys of the model and the optimizers are recorded to load them back by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_pipe.checkpoint import io
from lightning_pipe.checkpoint.save import CheckpointWriter
from lightning_pipe.errors import PipelineCheckpointError, PipelineUsageError

#: the state's key of the model and of each optimizer, in the trainer state
MODEL_KEY = "fabric_model_key"
OPTIMIZER_KEYS = "fabric_optimizer_keys"
#: keys of the format's own, which a state's values may not use
RESERVED = ("state_dict", "optimizer_states", "lr_schedulers", MODEL_KEY, OPTIMIZER_KEYS)


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _split_state(state: Mapping[str, Any], module: nn.Module) -> tuple[str, list[str]]:
    """The state's key of ``module`` and the keys of its optimizers; refuses another module or a reserved key."""
    modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
    if [k for k in modules if state[k] is module] != modules or len(modules) != 1:
        raise PipelineUsageError(
            f"`fabric.save`/`fabric.load` under Fabric(strategy='pipeline') take the state of the one model set up with"
            f" `fabric.setup_module`; the state's modules are {modules}. Put that model in the state once (e.g."
            " `{'model': model, 'optimizer': optimizer, 'step': step}`)."
        )
    reserved = [k for k in state if k in RESERVED]
    if reserved:
        raise PipelineUsageError(f"The state's keys {reserved} are the checkpoint format's own: rename them.")
    return modules[0], [k for k, v in state.items() if isinstance(v, Optimizer)]


def save_state(
    path: Path,
    state: Mapping[str, Any],
    module: nn.Module,
    topology: io.Topology,
    token: str,
    network_record: Mapping[str, Any] | None = None,
) -> None:
    """Write ``state`` as the checkpoint directory ``path`` (collective; committed when this returns)."""
    model_key, optimizer_keys = _split_state(state, module)
    checkpoint: dict[str, Any] = {
        "state_dict": io.model_state(module, topology.aliases),
        "optimizer_states": [io.optimizer_state(module, state[k], topology.aliases) for k in optimizer_keys],
        MODEL_KEY: model_key,
        OPTIMIZER_KEYS: optimizer_keys,
    }
    for key, value in state.items():
        if key != model_key and key not in optimizer_keys:
            checkpoint[key] = value.state_dict() if _stateful(value) else value
    cls = type(module)
    writer = CheckpointWriter(lambda: topology)
    # Fabric has no loaders of the strategy's to resume: the resume point is empty, and the save commits at once.
    writer.save(checkpoint, path, token, f"{cls.__module__}.{cls.__qualname__}", None, {}, network_record)
    writer.finish(None)


def load_state(
    path: Path,
    state: Mapping[str, Any],
    module: nn.Module,
    topology: io.Topology,
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Load checkpoint ``path`` into ``state`` in place (the model, its optimizers, ``load_state_dict`` of the other
    objects, the other values replaced); returns what the checkpoint holds that ``state`` did not ask for."""
    model_key, optimizer_keys = _split_state(state, module)
    rest = io.load(path, topology, module, [state[k] for k in optimizer_keys], strict=strict, weights_only=weights_only)
    rest.pop(io.RESUME_POINT, None)
    rest.pop("lr_schedulers", None)
    stored_model, stored_optimizers = rest.pop(MODEL_KEY, model_key), rest.pop(OPTIMIZER_KEYS, optimizer_keys)
    if optimizer_keys and list(stored_optimizers) != optimizer_keys:
        raise PipelineCheckpointError(
            f"Checkpoint {str(path)!r} holds the optimizers {list(stored_optimizers)} (model {stored_model!r}); the"
            f" state asks for {optimizer_keys}. Load with the same keys as the save."
        )
    missing = [k for k in state if k != model_key and k not in optimizer_keys and k not in rest]
    if strict and missing:
        raise PipelineCheckpointError(
            f"Checkpoint {str(path)!r} has no {missing}. Load with `strict=False` to leave them as they are."
        )
    for key, value in state.items():
        if key == model_key or key in optimizer_keys or key not in rest:
            continue
        stored = rest.pop(key)
        if _stateful(value):
            value.load_state_dict(stored)
        else:
            state[key] = stored  # type: ignore[index]
    return rest


def as_trainer_checkpoint(rest: dict[str, Any], path: Path, schedulers: int) -> dict[str, Any]:
    """What :func:`io.load` returned from ``path`` as the checkpoint dict Lightning's Trainer restores from: a
    ``fabric.save`` checkpoint has the model's weights and optimizer states (loaded already) and the Fabric state's
    values, which the LightningModule's ``on_load_checkpoint`` finds under their keys; the Trainer's loops start at
    zero. ``schedulers``: how many LR schedulers the Trainer restores (refused: Fabric saves none the Trainer could
    match). A Trainer checkpoint is returned as it is."""
    if MODEL_KEY not in rest:
        return rest
    from lightning.pytorch import __version__

    if schedulers and "lr_schedulers" not in rest:
        raise PipelineCheckpointError(
            f"Checkpoint {str(path)!r} was saved by `fabric.save` (Fabric(strategy='pipeline')), which writes no LR"
            f" scheduler state the Trainer can match to its {schedulers} LR scheduler(s) from `configure_optimizers`;"
            " resuming would restart them from scratch. Resume it without an LR scheduler, or continue it under Fabric."
        )
    rest.pop(MODEL_KEY)
    rest.pop(OPTIMIZER_KEYS, None)
    rest.setdefault("lr_schedulers", [])
    rest.setdefault("pytorch-lightning_version", __version__)
    return rest
