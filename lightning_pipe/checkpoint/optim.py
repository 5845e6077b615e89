"""Optimizer state keyed by parameter name, flat: one key per entry, so it reshards across pipeline layouts.

Keys follow torch's ``flatten_optimizer_state_dict`` format: ``state.<param fqn>.<name>`` (``exp_avg``, ``step``, ...)
and ``param_groups.<param fqn>.<hyperparameter>`` (every parameter carries its group's values). Unlike torch's
``get_optimizer_state_dict``/``set_optimizer_state_dict``, nothing here steps the optimizer: torch's helpers take a
zero-learning-rate step on an optimizer without state, which would turn a not-yet-stepped Adam into one that has
stepped once (its bias correction then differs from an uninterrupted run).

A single-device Lightning checkpoint stores torch's native form instead: parameters by their position in the optimizer
(param group by param group). :func:`full_param_groups` records those positions as names on the full model, before
the split; :func:`localize` and :func:`to_native` translate between the two forms with it.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_pipe.checkpoint.format import format_keys, same_state
from lightning_pipe.errors import PipelineCheckpointError

#: Per optimizer, per param group: the names of its parameters in the optimizer's order, on the full model (one device).
#: ``None`` stands for a parameter the LightningModule does not hold (it cannot be checkpointed by name).
ParamGroups = list[list[list[str | None]]]

_RECORD_ATTR = "_lightning_pipe_param_groups"


def param_names(module: nn.Module, aliases: Mapping[str, str] | None = None) -> dict[int, str]:
    """``id(parameter)`` to its name in ``module`` (the first name of a parameter registered twice; for a tied
    parameter whose first name here is another stage's alias, the name ``aliases`` maps it to)."""
    aliases = aliases or {}
    return {id(p): aliases.get(name, name) for name, p in module.named_parameters()}


def ordered_names(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> list[list[str]]:
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
    for saved, fqns in zip(native["param_groups"], ordered_names(optimizer, names)):
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
    return [fqn for group in ordered_names(optimizer, names) for fqn in group if fqn not in heads]


def target(
    optimizer: torch.optim.Optimizer,
    names: Mapping[int, str],
    stored: Mapping[str, Any],
    heads: Mapping[int, str] | None = None,
) -> dict[str, Any]:
    """Placeholders for the stored entries of this optimizer's parameters: empty tensors of the stored size and dtype
    (``stored`` maps flat keys to ``(size, dtype)``, or ``None`` for non-tensor entries, which DCP replaces).

    A state entry shaped like a sharded parameter (FSDP's DTensor) gets that parameter's sharding: DCP then reads
    just this rank's shard, whatever the layout that wrote it. ``heads``: for a param group without parameters on
    this rank, the stored name of a parameter it holds in the full model: its hyperparameters are read too.
    """
    params = {names[id(p)]: p for group in optimizer.param_groups for p in group["params"] if id(p) in names}
    fqns = [fqn for group in ordered_names(optimizer, names) for fqn in group]
    prefixes = tuple(f"{kind}.{fqn}." for fqn in fqns for kind in ("state", "param_groups"))
    prefixes += tuple(f"param_groups.{head}." for head in (heads or {}).values())
    out: dict[str, Any] = {}
    for key, meta in stored.items():
        if key.startswith(prefixes):
            out[key] = None if meta is None else _placeholder(params.get(_state_fqn(key)), meta[0], meta[1])
    return out


def _state_fqn(key: str) -> str | None:
    """The parameter name of a ``state.<fqn>.<entry>`` key (``None`` for other keys)."""
    return key[len("state.") :].rsplit(".", 1)[0] if key.startswith("state.") else None


def _placeholder(param: torch.Tensor | None, size: Any, dtype: torch.dtype) -> torch.Tensor:
    if param is not None and hasattr(param, "placements") and tuple(param.shape) == tuple(size):
        return torch.empty_like(param, dtype=dtype, requires_grad=False)
    return torch.empty(size, dtype=dtype)


def _nest(entries: Mapping[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in entries.items():
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def _under(keys: Sequence[str], flat: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The entries of ``flat`` whose key starts with ``prefix``, without it (``keys``: ``flat``'s keys, sorted)."""
    found = {}
    i = bisect.bisect_left(keys, prefix)
    while i < len(keys) and keys[i].startswith(prefix):
        found[keys[i][len(prefix) :]] = flat[keys[i]]
        i += 1
    return found


def _native(
    flat: Mapping[str, Any],
    groups: Sequence[Sequence[str | None]],
    defaults: Sequence[Mapping[str, Any]] | None,
    heads: Mapping[int, str] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """Torch's native state dict of an optimizer whose param groups hold the parameters ``groups`` names, from flat
    name-keyed entries, and the parameters without stored hyperparameters. A group without parameters takes its
    hyperparameters from those stored for ``heads[group]`` (a parameter it holds in the full model), else from
    ``defaults`` (the optimizer's own), when given."""
    keys = sorted(flat)
    native: dict[str, Any] = {"state": {}, "param_groups": []}
    missing: list[str] = []
    index = 0
    for g, fqns in enumerate(groups):
        group: dict[str, Any] = {}
        for fqn in fqns:
            values = _under(keys, flat, f"param_groups.{fqn}.") if fqn is not None else {}
            if not values:
                missing.append(str(fqn))
            for name, value in values.items():
                if name in group and not same_state(group[name], value):
                    raise PipelineCheckpointError(
                        f"The checkpoint gives parameters of one param group different {name!r} values"
                        f" ({group[name]!r} and {value!r} for {fqn!r}): `configure_optimizers` groups parameters"
                        " differently from the run that saved it. Group them the same way to resume."
                    )
                group[name] = value
            state = _under(keys, flat, f"state.{fqn}.") if fqn is not None else {}
            if state:
                native["state"][index] = _nest(state)
            index += 1
        if not fqns and defaults is not None:
            head = _under(keys, flat, f"param_groups.{heads[g]}.") if heads and g in heads else {}
            group = dict(head) or {k: v for k, v in defaults[g].items() if k != "params"}
        group["params"] = list(range(index - len(fqns), index))
        native["param_groups"].append(group)
    return native, missing


def unflatten(
    optimizer: torch.optim.Optimizer,
    names: Mapping[int, str],
    flat: Mapping[str, Any],
    heads: Mapping[int, str] | None = None,
) -> dict[str, Any]:
    """The native ``optimizer.state_dict()`` form of ``flat`` for this optimizer's parameters, in its own order.

    A parameter without stored ``state.*`` entries gets none (it had not been stepped; the optimizer creates its
    state lazily, as it would have). A param group without parameters on this rank keeps its own hyperparameters.
    """
    return _native(flat, ordered_names(optimizer, names), optimizer.param_groups, heads)[0]


# ---------------------------------------------------------------------------------------------------- one device
def _optimizers(conf: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in a ``configure_optimizers`` return value, in Lightning's order: an optimizer, a list or tuple
    of them, ``(optimizers, schedulers)``, a dict with an ``"optimizer"`` key, or a list of such dicts."""
    if isinstance(conf, torch.optim.Optimizer):
        return [conf]
    if isinstance(conf, Mapping):
        return _optimizers(conf.get("optimizer"))
    found: list[torch.optim.Optimizer] = []
    if isinstance(conf, (list, tuple)):
        for item in conf:
            found += [o for o in _optimizers(item) if all(o is not f for f in found)]
    return found


def full_param_groups(module: Any) -> ParamGroups:
    """The optimizers' param groups of the LightningModule ``module`` on one device, as parameter names.

    Runs ``module.configure_optimizers()`` (the optimizers are discarded). ``module`` must still hold every
    parameter, i.e. this runs before the split; parameters on the meta device cost nothing, and optimizers allocate
    their state lazily (except a few, such as Adagrad, which allocate it in the constructor).
    """
    names = param_names(module)
    return [
        [[names.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]
        for optimizer in _optimizers(module.configure_optimizers())
    ]


def record_param_groups(module: Any) -> None:
    """Keep :func:`full_param_groups` of ``module`` on it, for this and later Trainer entries (which find it split).

    This calls the user's ``configure_optimizers`` once more than Lightning does, on the full (meta-device) model; an
    error it raises propagates, with a note saying why the call happened.
    """
    module.__dict__.pop(_RECORD_ATTR, None)
    try:
        module.__dict__[_RECORD_ATTR] = full_param_groups(module)
    except Exception as err:
        note = (
            "lightning-pipe: raised by `configure_optimizers`, which the strategy calls once on the full model before"
            " it splits it, to record the optimizers' single-device parameter order (for single-device checkpoints)."
            " It must work on the model as `configure_model` built it."
        )
        if hasattr(err, "add_note"):
            err.add_note(note)
        raise


def recorded_param_groups(module: Any) -> ParamGroups | None:
    """What :func:`record_param_groups` kept on ``module``; ``None`` if nothing was recorded."""
    return module.__dict__.get(_RECORD_ATTR)


def _describe_groups(sizes: Sequence[int]) -> str:
    return f"{len(sizes)} param group(s) of {', '.join(map(str, sizes))} parameter(s)"


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()  # out of the memory-mapped file, into this process's memory
    if isinstance(value, Mapping):
        return {k: _cloned(v) for k, v in value.items()}
    return value


def localize(
    native: Mapping[str, Any],
    groups: Sequence[Sequence[str | None]],
    local: Sequence[Sequence[str]],
    index: int,
) -> dict[str, Any]:
    """Restrict a single-device optimizer state dict to one rank's optimizer.

    ``native`` numbers parameters by position; ``groups`` names those positions (this optimizer's entry of
    :func:`full_param_groups`); ``local`` names the parameters of this rank's optimizer per param group. Returns the
    state dict this rank's optimizer loads (tensors copied); ``index`` is the optimizer's index, for messages.
    """
    saved = native.get("param_groups")
    if not isinstance(saved, Sequence) or not all(
        isinstance(g, Mapping) and all(isinstance(i, int) for i in g.get("params", [None])) for g in saved
    ):
        raise PipelineCheckpointError(
            f"Optimizer {index}'s state in the checkpoint is not in torch's native form (param groups listing"
            " parameter positions): it was not saved by a single-device or DDP run. Resume it with the strategy that"
            " saved it."
        )
    sizes, expected = [len(g["params"]) for g in saved], [len(g) for g in groups]
    if sizes != expected:
        raise PipelineCheckpointError(
            f"Optimizer {index} in the checkpoint has {_describe_groups(sizes)}, but `configure_optimizers` builds"
            f" {_describe_groups(expected)} on the full model. Build the optimizers as the run that saved it did: the"
            " same param groups, over the same parameters, in the same order."
        )
    if len(local) != len(groups):
        raise PipelineCheckpointError(
            f"`configure_optimizers` builds optimizer {index} with {len(local)} param group(s) on this rank's stages"
            f" but {len(groups)} on the full model. Keep every param group (an empty one too) when a rank holds none"
            " of its parameters, so that groups correspond to the single-device optimizer's."
        )
    where = {fqn: (g, i) for g, (s, fqns) in enumerate(zip(saved, groups)) for i, fqn in zip(s["params"], fqns)}
    state = native.get("state", {})
    out: dict[str, Any] = {"state": {}, "param_groups": []}
    position = 0
    for g, fqns in enumerate(local):
        for fqn in fqns:
            if where.get(fqn, (None,))[0] != g:
                raise PipelineCheckpointError(
                    f"`configure_optimizers` puts {fqn!r} in param group {g} of optimizer {index} on this rank's"
                    f" stages, but in {'no group' if fqn not in where else f'group {where[fqn][0]}'} on the full"
                    " model. Select each group's parameters by name or module, not by position, so that the pipeline"
                    " and one device build the same groups."
                )
            if where[fqn][1] in state:
                out["state"][position] = _cloned(state[where[fqn][1]])
            position += 1
        hyperparameters = {k: v for k, v in saved[g].items() if k != "params"}
        out["param_groups"].append({**hyperparameters, "params": list(range(position - len(fqns), position))})
    return out


def to_native(flat: Mapping[str, Any], groups: Sequence[Sequence[str | None]], index: int) -> dict[str, Any]:
    """A single-device optimizer state dict from every stage's flat entries of one optimizer, numbering parameters
    as ``groups`` (this optimizer's entry of :func:`full_param_groups`) lists them."""
    empty = [g for g, fqns in enumerate(groups) if not fqns]
    if empty:
        raise PipelineCheckpointError(
            f"Param group {empty[0]} of optimizer {index} holds no parameters, so the checkpoint has no"
            " hyperparameters for it and a single-device optimizer state cannot be built. Drop empty param groups in"
            " `configure_optimizers`, or consolidate without `--with-optimizer`."
        )
    native, missing = _native(flat, groups, None)
    if missing:
        raise PipelineCheckpointError(
            f"The checkpoint has no state for optimizer {index}'s parameters {format_keys(missing)}, which its"
            " recorded param groups list: it is incomplete. Consolidate another checkpoint, or drop"
            " `--with-optimizer`."
        )
    return native


def describe_missing(missing: list[str], index: int) -> str:
    return f"no state for optimizer {index}'s parameters {format_keys(missing)}"
