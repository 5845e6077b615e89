"""Optimizer state keyed by parameter name, flat: one key per entry, so it reshards across pipeline layouts.

Keys follow torch's ``flatten_optimizer_state_dict`` format: ``state.<param fqn>.<name>`` (``exp_avg``, ``step``, ...)
and ``param_groups.<param fqn>.<hyperparameter>`` (every parameter carries its group's values). Unlike torch's
``get_optimizer_state_dict``/``set_optimizer_state_dict``, nothing here steps the optimizer: torch's helpers take a
zero-learning-rate step on an optimizer without state, which would turn a not-yet-stepped Adam into one that has
stepped once (its bias correction then differs from an uninterrupted run).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_pipe.checkpoint.format import format_keys, same_state
from lightning_pipe.errors import PipelineCheckpointError


def param_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter)`` to its name in ``module`` (the first name of a parameter registered twice)."""
    return {id(p): name for name, p in module.named_parameters()}


def _ordered(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> list[list[str]]:
    """Parameter names per param group, in the optimizer's order."""
    groups = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise PipelineCheckpointError(
                f"{type(optimizer).__name__} holds {len(missing)} parameter(s) that are not in the LightningModule, so"
                " they have no name to checkpoint them under. Build optimizers only over `self.parameters()`."
            )
        groups.append([names[id(p)] for p in group["params"]])
    return groups


def flatten(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> dict[str, Any]:
    """The optimizer's state and hyperparameters under flat, name-based keys (values are not copied)."""
    native = optimizer.state_dict()
    flat: dict[str, Any] = {}
    index_to_name: dict[int, str] = {}
    for saved, fqns in zip(native["param_groups"], _ordered(optimizer, names)):
        for index, fqn in zip(saved["params"], fqns):
            index_to_name[index] = fqn
            for key, value in saved.items():
                if key != "params":
                    flat[f"param_groups.{fqn}.{key}"] = value
    for index, entries in native["state"].items():
        for key, value in entries.items():
            flat[f"state.{index_to_name[index]}.{key}"] = value
    return flat


def missing_params(optimizer: torch.optim.Optimizer, names: Mapping[int, str], stored: Any) -> list[str]:
    """Parameters of ``optimizer`` of which ``stored`` (flat keys) has no hyperparameters at all."""
    heads = {k.split(".", 1)[1].rsplit(".", 1)[0] for k in stored if k.startswith("param_groups.")}
    return [fqn for group in _ordered(optimizer, names) for fqn in group if fqn not in heads]


def target(optimizer: torch.optim.Optimizer, names: Mapping[int, str], stored: Mapping[str, Any]) -> dict[str, Any]:
    """Placeholders for the stored entries of this optimizer's parameters: empty tensors of the stored size and dtype
    (``stored`` maps flat keys to ``(size, dtype)``, or ``None`` for non-tensor entries, which DCP replaces)."""
    prefixes = tuple(
        f"{kind}.{fqn}." for group in _ordered(optimizer, names) for fqn in group for kind in ("state", "param_groups")
    )
    out: dict[str, Any] = {}
    for key, meta in stored.items():
        if key.startswith(prefixes):
            out[key] = None if meta is None else torch.empty(meta[0], dtype=meta[1])
    return out


def _nest(entries: Mapping[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in entries.items():
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def unflatten(optimizer: torch.optim.Optimizer, names: Mapping[int, str], flat: Mapping[str, Any]) -> dict[str, Any]:
    """The native ``optimizer.state_dict()`` form of ``flat`` for this optimizer's parameters, in its own order.

    A parameter without stored ``state.*`` entries gets none (it had not been stepped; the optimizer creates its
    state lazily, as it would have).
    """
    native: dict[str, Any] = {"state": {}, "param_groups": []}
    index = 0
    for fqns in _ordered(optimizer, names):
        group: dict[str, Any] = {}
        for fqn in fqns:
            prefix = f"param_groups.{fqn}."
            for key, value in flat.items():
                if not key.startswith(prefix):
                    continue
                name = key[len(prefix) :]
                if name in group and not same_state(group[name], value):
                    raise PipelineCheckpointError(
                        f"The checkpoint gives parameters of one param group different {name!r} values"
                        f" ({group[name]!r} and {value!r} for {fqn!r}): `configure_optimizers` groups parameters"
                        " differently from the run that saved it. Group them the same way to resume."
                    )
                group[name] = value
            prefix = f"state.{fqn}."
            state = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
            if state:
                native["state"][index] = _nest(state)
            index += 1
        group["params"] = list(range(index - len(fqns), index))
        native["param_groups"].append(group)
    return native


def describe_missing(missing: list[str], index: int) -> str:
    return f"no state for optimizer {index}'s parameters {format_keys(missing)}"
