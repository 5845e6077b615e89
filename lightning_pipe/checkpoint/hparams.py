"""Networks kept in the hyperparameters, saved as one device saves them.

A network passed to ``__init__`` and kept by ``save_hyperparameters()`` is the object the pipeline cuts: pickled as it
is, a checkpoint would hold one rank's units, stand-ins for the others and the interceptor bound on the instance.
Before the cut the strategy keeps a copy of each such network whose tensors are on the meta device (the structure as
the user built it, no tensor memory), with the names those tensors have in the LightningModule's state dict
(:func:`record`). A save puts the copy in the hyperparameters and the names in the manifest (:func:`for_checkpoint`);
``consolidate`` fills the copy with the consolidated weights (:func:`fill`), so ``load_from_checkpoint`` of the single
file builds the module around the whole trained network, as from one device's checkpoint.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_pipe.checkpoint import format as fmt
from lightning_pipe.errors import PipelineCheckpointError

_RECORD_ATTR = "_lightning_pipe_hparams_networks"


@dataclass(frozen=True)
class KeptNetwork:
    """A hyperparameter network as the user built it, its state on the meta device."""

    network: nn.Module
    #: its state-dict names -> the LightningModule's names of the same tensors
    names: dict[str, str]


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    empty = torch.empty_like(tensor, device="meta")
    return nn.Parameter(empty, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty


def _as_trained(value: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """What replaces a meta tensor: ``value``, as a ``Parameter`` where the tensor was one."""

    def replace(tensor: torch.Tensor) -> torch.Tensor:
        return nn.Parameter(value, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else value

    return replace


def _replaced(network: nn.Module, tensors: Mapping[str, Callable[[torch.Tensor], torch.Tensor]]) -> nn.Module:
    """A deep copy of ``network`` whose state-dict tensors named in ``tensors`` are ``tensors[name](tensor)``; a tensor
    reached under several names is replaced once, so ties stay ties."""
    memo: dict[int, Any] = {}
    for name, tensor in network.state_dict(keep_vars=True).items():
        if name in tensors and id(tensor) not in memo:
            memo[id(tensor)] = tensors[name](tensor)
    return copy.deepcopy(network, memo)


def record(module: Any) -> None:
    """Keep on ``module`` (before the cut) a meta copy of every hyperparameter that is a module holding some of
    ``module``'s tensors. Costs the structure, not the tensors: the other tensors of such a network (non-persistent
    buffers) are copied as they are."""
    module.__dict__.pop(_RECORD_ATTR, None)
    hparams = getattr(module, "hparams", None)
    if not isinstance(hparams, Mapping):
        return
    full: dict[int, str] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        full.setdefault(id(tensor), name)  # a tied parameter's first name: the one checkpoints store
    kept = {}
    for key, value in hparams.items():
        if not isinstance(value, nn.Module):
            _warn_nested(key, value, full)
            continue
        names = {n: full[id(t)] for n, t in value.state_dict(keep_vars=True).items() if id(t) in full}
        if names:
            kept[key] = KeptNetwork(_replaced(value, dict.fromkeys(names, _on_meta)), names)
    if kept:
        module.__dict__[_RECORD_ATTR] = kept


def _warn_nested(key: str, value: Any, full: Mapping[int, str]) -> None:
    """A network inside a list, tuple or dict hyperparameter is saved as it is (this rank's cut copy): say so."""
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    inner = [m for m in items if isinstance(m, nn.Module)]
    if any(id(t) in full for m in inner for t in m.state_dict(keep_vars=True).values()):
        rank_zero_warn(
            f"lightning-pipe: the hyperparameter {key!r} holds networks of the module inside a {type(value).__name__},"
            " which checkpoints save as they are after the split (this rank's stages only), so"
            " `load_from_checkpoint` of a consolidated file cannot build them whole. Pass each network to `__init__`"
            f" as an argument of its own, or keep them out of the hyperparameters"
            f" (`self.save_hyperparameters(ignore=[{key!r}])`) and pass them to `load_from_checkpoint`."
        )


def for_checkpoint(module: Any, checkpoint: dict[str, Any]) -> None:
    """Put the recorded copies in ``checkpoint``'s hyperparameters in place of the cut networks, and their names under
    ``fmt.HYPERPARAMETER_NETWORKS``, which the save moves into the manifest (for ``consolidate``)."""
    kept: dict[str, KeptNetwork] = module.__dict__.get(_RECORD_ATTR) or {}
    hparams = checkpoint.get("hyper_parameters")
    if not kept or not isinstance(hparams, dict):
        return
    keys = [key for key in kept if isinstance(hparams.get(key), nn.Module)]
    if keys:
        checkpoint["hyper_parameters"] = {**hparams, **{key: kept[key].network for key in keys}}
        checkpoint[fmt.HYPERPARAMETER_NETWORKS] = {key: dict(kept[key].names) for key in keys}


def fill(hparams: dict[str, Any], weights: Mapping[str, torch.Tensor], names: Mapping[str, Mapping[str, str]]) -> None:
    """Replace each recorded network of ``hparams`` by a copy holding ``weights`` (the consolidated state dict, the
    LightningModule's names) in place of its meta tensors."""
    for key, own_names in names.items():
        network = hparams.get(key)
        if not isinstance(network, nn.Module):
            continue
        missing = sorted(full for full in own_names.values() if full not in weights)
        if missing:
            raise PipelineCheckpointError(
                f"The hyperparameter {key!r} is a network whose tensors {missing[:3]} are not among the checkpoint's"
                " weights (the module's tensors were renamed or removed after the strategy recorded the network at the"
                " split), so it cannot hold the trained values. Keep the network out of the hyperparameters"
                f" (`self.save_hyperparameters(ignore=[{key!r}])`) and pass it to `load_from_checkpoint`."
            )
        filled = _replaced(network, {own: _as_trained(weights[full]) for own, full in own_names.items()})
        left = [n for n, t in filled.state_dict(keep_vars=True).items() if t.is_meta]
        if left:
            raise PipelineCheckpointError(
                f"The hyperparameter {key!r} is a network whose tensors {left[:3]} are on the meta device and are not"
                " the module's own (it was built without values), so the checkpoint has none for them. Keep the"
                f" network out of the hyperparameters (`self.save_hyperparameters(ignore=[{key!r}])`) and pass it to"
                " `load_from_checkpoint`."
            )
        hparams[key] = filled
