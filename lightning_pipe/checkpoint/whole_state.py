"""A whole model's state dict into one rank's stages: ``module.load_state_dict(full_state_dict)`` as on one device.

Scripts load weights with a strict ``load_state_dict`` of the whole model (litgpt's ``load_checkpoint``,
``fabric.load_raw``, a ``torch.load`` in ``setup``). On a pipelined module each rank keeps the entries of its own
stages; the others are checked against the whole model's names and shapes, recorded before the cut
(``Split.state_shapes``), so every rank reports the same missing keys, unexpected keys and size mismatches that one
device would, without communicating. No collective: ranks may call it at different times, or only some of them.

A state dict that holds no other stage's entry is this rank's own (the strategy's per-rank checkpoint loads, a rank's
``state_dict()`` loaded back): it loads as into any module, strict about this rank's entries only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_pipe.comm.dtensor import is_dtensor, place_like
from lightning_pipe.errors import PipelineCheckpointError
from lightning_pipe.split.tied import Tie

#: a state dict entry's shape (``None``: an entry that is not a tensor, such as a module's extra state)
Shapes = Mapping[str, "tuple[int, ...] | None"]


def keep_own_entries(network: nn.Module, whole: Shapes, ties: Sequence[Tie]) -> RemovableHandle:
    """Make ``network.load_state_dict`` (or a parent's) take a state dict of the whole network: this rank's entries are
    loaded, the other stages' are checked against ``whole`` (``Split.state_shapes``, the uncut network's) and dropped.
    ``ties``: parameters shared across stages; every rank's copy gets the value one device's shared parameter would.
    Returns the handle that removes the hook."""
    return network.register_load_state_dict_pre_hook(_KeepOwnEntries(whole, ties))


class _KeepOwnEntries:
    """The load-state-dict pre-hook of :func:`keep_own_entries` (torch calls it with the module's part of the state
    dict, before the module and its children load it)."""

    def __init__(self, whole: Shapes, ties: Sequence[Tie]) -> None:
        self.whole, self.ties = whole, ties

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A pickled or copied network (`torch.save(model)`, kept in the hyperparameters) loads as any module: the
        # hook belongs to this rank's run.
        return _no_hook, ()

    def __call__(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        whole = self.whole
        given = {k[len(prefix) :]: state_dict[k] for k in list(state_dict) if k.startswith(prefix)}
        own = module.state_dict(keep_vars=True)
        if not any(name in whole and name not in own for name in given):
            return  # this rank's entries only (the strategy's own per-rank loads, a rank's `state_dict()`): as torch
        filled = _fill_ties(given, own, self.ties, prefix)
        for name, value in filled.items():
            state_dict[prefix + name] = value
        for name, value in given.items():
            if name not in own or name not in whole:
                del state_dict[prefix + name]  # another stage's (checked below) or unknown (reported below)
            elif isinstance(value, torch.Tensor) and not is_dtensor(value) and is_dtensor(own[name]):
                if tuple(value.shape) == tuple(own[name].shape):  # a mismatch is torch's to report
                    state_dict[prefix + name] = place_like(value, own[name])  # this rank's slice of the whole tensor
        unexpected_keys.extend(prefix + name for name in given if name not in whole)
        missing_keys.extend(prefix + n for n in whole if n not in given and (n not in own or n in filled))
        for name, value in given.items():
            shape = whole.get(name)
            if name in own or shape is None or not isinstance(value, torch.Tensor) or tuple(value.shape) == shape:
                continue
            error_msgs.append(
                f"size mismatch for {prefix + name}: copying a param with shape {value.shape} from checkpoint, the"
                f" shape in current model is {torch.Size(shape)}."
            )


def _no_hook() -> Any:
    return _pass


def _pass(*args: Any) -> None:
    """What a copied network's hook becomes: nothing."""


def _fill_ties(given: Mapping[str, Any], own: Mapping[str, Any], ties: Sequence[Tie], prefix: str) -> dict[str, Any]:
    """For each parameter shared across stages: the value of its names this rank holds but ``given`` lacks (one
    device's shared parameter takes the value of the names given). Names given different values are refused: one
    device would keep one of them, the stages each their own."""
    filled = {}
    for tie in ties:
        present = [n for n in tie.names if n in given]
        if not present:
            continue
        first = given[present[0]]
        differing = [n for n in present[1:] if not _same(given[n], first)]
        if differing:
            names = ", ".join(repr(prefix + n) for n in (present[0], *differing))
            raise PipelineCheckpointError(
                f"The state dict gives the tied parameter {names} different values; the model holds one parameter"
                " under these names (its stages hold a copy each), so only one value can be loaded. Give every name"
                f" the same tensor, or only {prefix + tie.canonical!r}."
            )
        filled.update({n: first for n in tie.names if n in own and n not in given})
    return filled


def _same(a: Any, b: Any) -> bool:
    return a is b or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b))
