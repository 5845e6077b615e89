"""Module surgery: cut a network down to the stages one rank owns, keeping the full model's parameter names.

Three frontends build the stage modules:

- ``modules``: the network's own ``forward`` runs on every stage with the units other stages own removed (set to
  ``None``, or deleted from their ``nn.ModuleList``/``nn.ModuleDict``/``nn.Sequential``). An ``nn.Sequential``
  network needs no change; any other network's ``forward`` must skip units that are ``None``.
- ``dataflow``: like ``modules``, but absent units are stand-ins and the forward needs no change
  (:mod:`lightning_pipe.split.dataflow`).
- ``trace``: torch's tracer (``torch.distributed.pipelining.pipeline``) cuts an unmodified network at block
  boundaries, from an example microbatch.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_pipe.compat import torch as torch_compat
from lightning_pipe.errors import PipelineModelError
from lightning_pipe.models.base import Placeholder, StageCall
from lightning_pipe.models.units import CONTAINERS


def _ancestors(names: Iterable[str]) -> set[str]:
    out: set[str] = set()
    for name in names:
        parts = name.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return out


#: Set on the class of a placeholder that takes a unit's place but is not a block of this stage (wrappers skip it)
STANDS_IN = "_lightning_pipe_stands_in"


def _remove_child(parent: nn.Module, name: str, stand_in: nn.Module | None = None) -> None:
    if stand_in is not None:
        # Replaced, not removed: a forward that calls every unit (or counts positions in a block list) still runs.
        torch_compat.children(parent)[name] = stand_in
    elif isinstance(parent, CONTAINERS):
        # Deleting the slot keeps the other entries' keys, so "layers.5" stays "layers.5" on the stage that owns it.
        del torch_compat.children(parent)[name]
    else:
        setattr(parent, name, None)


def _split_name(fqn: str) -> tuple[str, str]:
    parent, _, child = fqn.rpartition(".")
    return parent, child


def check_ownership(module: nn.Module, units: Sequence[str]) -> None:
    """Refuse networks with parameters that no stage would hold. (A parameter several stages hold is a tie:
    :mod:`lightning_pipe.split.tied`.)"""
    owners: set[int] = set()
    for unit in units:
        owners.update(id(p) for p in module.get_submodule(unit).parameters())
    for pname, param in module.named_parameters(remove_duplicate=False):
        if id(param) not in owners:
            raise PipelineModelError(
                f"Parameter {pname!r} lies outside every pipeline unit ({', '.join(units[:4])}, ...), so no stage"
                " would own it. Move it into a submodule that runs before, inside or after the block stack."
            )


def prune(
    module: nn.Module, keep: Iterable[str], units: Sequence[str], placeholder: Placeholder | None = None
) -> nn.Module:
    """Remove, in place, every unit of ``units`` not in ``keep``; returns ``module``.

    ``placeholder(unit)``, where given and not ``None``, is put in place of a removed unit.
    """
    keep = set(keep)
    for unit in units:
        if unit in keep:
            continue
        if not unit:  # the network is one unit (models.units.ONE_UNIT): a stage without it holds none of its state
            for name in [n for n, _ in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))]:
                delattr(module, name)
            continue
        parent, child = _split_name(unit)
        stand_in = placeholder(unit) if placeholder is not None else None
        _remove_child(module.get_submodule(parent) if parent else module, child, stand_in)
    return module


class PassOn(nn.Module):
    """The body of a stage that holds no unit of a one-unit network (:func:`call_passing_on` runs it)."""


class _Contiguous(torch.autograd.Function):
    """A copy of its input whose backward hands a contiguous gradient on: a pass-on stage's input gradient is its
    output's, which a loss may make an expanded tensor (``sum``'s), and torch receives gradients into contiguous
    buffers (a strided one fails ``irecv``)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def call_passing_on(stage_call: StageCall) -> StageCall:
    """``stage_call``, except that a :class:`PassOn` stage returns the activation it received unchanged: the network
    is one unit, so nothing of its forward lies after it."""

    def call(body: nn.Module, args: tuple, kwargs: dict, received: tuple | None, is_first: bool, is_last: bool) -> Any:
        if isinstance(body, PassOn):
            assert received is not None  # the one unit is on the first stage
            passed = tuple(_Contiguous.apply(t) if t.requires_grad else t for t in received)
            return passed[0] if len(passed) == 1 else passed
        return stage_call(body, args, kwargs, received, is_first, is_last)

    return call


def stage_view(
    module: nn.Module, keep: Iterable[str], units: Sequence[str], placeholder: Placeholder | None = None
) -> nn.Module:
    """A shallow copy of ``module`` holding only the units in ``keep``.

    Kept units (and the parameters in them) are the same objects as in ``module``: the view shares storage and
    gradients with it. Used to give each of a rank's stages its own module while the rank's optimizer and
    checkpoint see one module with global names. Units not kept are dropped as by ``prune``, or replaced by
    ``placeholder(unit)``.
    """
    keep = set(keep)
    unit_set = set(units)
    if "" in unit_set:  # the network is one unit
        return copy.copy(module) if "" in keep else PassOn()
    paths = _ancestors(unit_set)

    def view(mod: nn.Module, prefix: str) -> nn.Module:
        clone = copy.copy(mod)
        children = dict(torch_compat.children(mod))
        for name, child in torch_compat.children(mod).items():
            fqn = prefix + name
            if fqn in unit_set:
                if fqn not in keep:
                    stand_in = placeholder(fqn) if placeholder is not None else None
                    if stand_in is not None:
                        children[name] = stand_in
                    elif isinstance(mod, CONTAINERS):
                        del children[name]
                    else:
                        children[name] = None
            elif fqn in paths and child is not None:
                children[name] = view(child, fqn + ".")
        torch_compat.set_children(clone, children)
        return clone

    return view(module, "")


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def find_block(module: nn.Module, name: str) -> nn.Module | None:
    """The submodule ``name`` (dotted) of ``module``, or ``None`` where a slot on the way is empty or missing, or
    holds a stand-in (a unit another stage holds)."""
    current: nn.Module | None = module
    for part in name.split(".") if name else []:
        current = torch_compat.children(current).get(part) if current is not None else None
    return None if getattr(type(current), STANDS_IN, False) else current


def trace_stages(
    module: nn.Module, example_args: tuple[Any, ...], example_kwargs: dict[str, Any], split_fqns: Sequence[str]
) -> list[nn.Module]:
    """Cut an unmodified network with torch's tracer at the blocks named in ``split_fqns`` (each begins a stage)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    try:
        pipe = pipeline(
            module,
            mb_args=example_args,
            mb_kwargs=example_kwargs or None,
            split_spec={fqn: SplitPoint.BEGINNING for fqn in split_fqns},
        )
    except (torch.OutOfMemoryError, MemoryError):
        raise  # out of memory is out of memory, not a network the tracer cannot read
    except Exception as err:  # torch.export raises many types; all mean the same thing to the user
        raise PipelineModelError(
            f"torch's tracer could not split {type(module).__name__} ({type(err).__name__}: {err}). Use"
            " `frontend='modules'` and make the network's forward skip units that are None."
        ) from err
    if pipe.num_stages != len(split_fqns) + 1:
        raise PipelineModelError(
            f"The tracer produced {pipe.num_stages} stages instead of {len(split_fqns) + 1}: the split points"
            f" {list(split_fqns)} are not all called in the traced forward."
        )
    modules = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    _chain_stage_inputs(pipe.split_gm.graph, modules)
    return modules


def _chain_stage_inputs(top: Any, modules: Sequence[nn.Module]) -> None:
    """Rewrite traced stages so each one receives inputs only from the stage before it.

    The tracer lets a later stage read values an earlier stage computed (litgpt's rope ``cos``/``sin`` from the
    first stage feed every block). torch's multi-stage schedules refuse such skip connections, so every stage in
    between takes those values as extra inputs and returns them as extra outputs.
    """
    import operator

    calls = [n for n in top.nodes if n.op == "call_module" and str(n.target).startswith("submod")]
    stage_of = {call: k for k, call in enumerate(calls)}

    def source(value: Any) -> tuple[int, int | None]:
        if value in stage_of:
            return stage_of[value], None
        if value.op == "call_function" and value.target is operator.getitem and value.args[0] in stage_of:
            return stage_of[value.args[0]], value.args[1]
        return -1, None  # a network input

    needs = [list(call.args) for call in calls]
    for k in range(len(calls) - 1, 0, -1):
        for value in needs[k]:
            if source(value)[0] < k - 1 and value not in needs[k - 1]:
                if k - 1 == 0:
                    raise PipelineModelError(
                        f"A traced stage after the first reads the network input {value.name!r} that the first stage"
                        " does not use; pass it through the network's first blocks or use `frontend='modules'`."
                    )
                needs[k - 1].append(value)
    for k in range(len(calls) - 1):
        graph = modules[k].graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        local = dict(zip(calls[k].args, placeholders))
        anchor = placeholders[-1]
        for value in needs[k][len(calls[k].args) :]:
            with graph.inserting_after(anchor):
                anchor = local[value] = graph.placeholder(f"pass_{value.name}")
        output = next(n for n in graph.nodes if n.op == "output")
        produced = output.args[0]
        outs = []
        for value in needs[k + 1]:
            stage, index = source(value)
            if stage == k:
                outs.append(produced if index is None else produced[index])
            else:
                outs.append(local[value])
        output.args = (tuple(outs) if len(outs) > 1 else outs[0],)
        graph.lint()
        modules[k].recompile()


def retarget_meta_constants(graph_module: nn.Module, device: torch.device) -> None:
    """Traced graphs bake the tracing device into factory calls (``arange(device=meta)``); use ``device``."""
    graph = getattr(graph_module, "graph", None)
    if graph is None:
        return
    changed = False
    for node in graph.nodes:
        dev = node.kwargs.get("device")
        if isinstance(dev, torch.device) and dev.type == "meta":
            node.kwargs = {**node.kwargs, "device": device}
            changed = True
    if changed:
        graph_module.recompile()


def _insert(root: nn.Module, name: str, module: nn.Module) -> None:
    """Place ``module`` at dotted ``name`` under ``root``, creating plain containers on the way."""
    parent = root
    parts = name.split(".")
    for part in parts[:-1]:
        if torch_compat.children(parent).get(part) is None:
            parent.add_module(part, nn.Module())
        parent = torch_compat.children(parent)[part]
    existing = torch_compat.children(parent).get(parts[-1])
    if existing is None:
        parent.add_module(parts[-1], module)
    elif existing is not module:
        # Two traced stages of one rank both hold a module of this name: the tracer puts a parameter shared by two
        # stages into both (e.g. `head.weight` tied to the embedding also lands in the first stage). Keep one
        # module and give it what only the other holds (the head's bias), so nothing escapes the optimizer.
        for pname, param in torch_compat.own_parameters(module).items():
            if torch_compat.own_parameters(existing).get(pname) is None and param is not None:
                existing.register_parameter(pname, param)
        for bname, buffer in torch_compat.own_buffers(module).items():
            if bname not in torch_compat.own_buffers(existing) and buffer is not None:
                existing.register_buffer(bname, buffer)


def merge(modules: Sequence[nn.Module], state_keys: set[str] | None = None) -> nn.Module:
    """A new module holding the parameters and buffers of ``modules`` under the same names.

    It gives a rank's traced stages one home on the LightningModule (for the optimizer and checkpoints) that is not
    itself a stage module, so intercepting its calls never intercepts a stage's. Buffers whose names are not in
    ``state_keys`` (the original network's state dict) stay out of the state dict, as they were in the original.
    """
    root = nn.Module()
    for mod in modules:
        for name, sub in mod.named_modules():
            params, buffers = torch_compat.own_parameters(sub), torch_compat.own_buffers(sub)
            if not (params or buffers):
                continue
            if not name:
                for pname, p in params.items():
                    root.register_parameter(pname, p)
                for bname, b in buffers.items():
                    root.register_buffer(bname, b)
            else:
                _insert(root, name, sub)
    if state_keys is not None:
        for name, sub in root.named_modules():
            prefix = f"{name}." if name else ""
            for bname in torch_compat.own_buffers(sub):
                if prefix + bname not in state_keys:
                    torch_compat.mark_non_persistent(sub, bname)
    return root
