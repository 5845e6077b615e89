"""Route plans of the dataflow frontend: which unit outputs travel to which stages, found by running the network once
on fake tensors.

The whole network runs on a *skeleton* (a copy whose parameters are fake tensors: shapes without data) with the
microbatch's real arguments. Every unit call returns fake outputs, each labelled with the unit output it is
(``(unit, ordinal, leaf)``: the ``ordinal``-th call of ``unit``, its ``leaf``-th tensor). A ``TorchFunctionMode``
carries the labels through the code between units (the *glue*: residual adds, scaling, reshapes, masks), so each
unit call knows which unit outputs its arguments were computed from, and so does the network's output. A unit
output then travels from the stage that holds its unit to the last stage that reads it, through the stages in
between: only as far as it is needed. Values the glue computes from the network's input alone (masks, positions)
carry no label: every stage computes them itself.

Pure: no process group. The plan of one call signature is the same on every rank, so no rank needs to ask another.
"""

from __future__ import annotations

import functools
import linecache
import sys
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from lightning_pipe.compat import torch as torch_compat
from lightning_pipe.errors import PipelineModelError
from lightning_pipe.structures import map_structure, tensors_in

#: ``(unit, ordinal, leaf)``: the ``leaf``-th tensor returned by the ``ordinal``-th call of ``unit``
Key = tuple[str, int, int]
#: ``(unit, ordinal)``: one call of a unit
CallId = tuple[str, int]
#: where the network's output is read: the last stage
OUTPUT = "the network's output"
DOCS = "docs/crossing-stages.md"
_SHAPE_ONLY = frozenset(
    {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like"}
)
_LIBRARIES = tuple(str(Path(m.__file__).resolve().parent) for m in (torch, sys.modules[__name__.split(".")[0]]))


@dataclass(frozen=True)
class _Param:
    """The label of a parameter read outside its unit: the units that hold it (several when it is tied)."""

    name: str
    units: tuple[str, ...]


@dataclass(frozen=True)
class RoutePlan:
    """The routes of one call signature: what each stage receives and sends, and when it may stop."""

    #: every unit call, in the order the forward makes them
    calls: tuple[CallId, ...]
    #: the fake outputs of every unit call (what a stage that does not hold the unit returns in its place)
    outputs: Mapping[CallId, Any]
    #: per boundary ``b`` (stage ``b`` to ``b + 1``): the unit outputs crossing it, in call order
    sends: tuple[tuple[Key, ...], ...]
    #: per stage: the index in ``calls`` of its last unit call (a stage before the last stops there)
    last_call: tuple[int, ...]
    #: units whose output shapes came from running them on zero weights (they cannot run on fake tensors)
    probed: tuple[str, ...] = ()
    #: per stage: whether it holds trainable units whose calls read nothing the stage received (a decoder's
    #: embedding on a middle stage); torch's split backward loses their weights' gradients (see ``off_input``)
    off_input: tuple[bool, ...] = ()
    #: tensors in the network's output (the last stage's output must hold as many)
    output_tensors: int = 0

    def position(self, call: CallId) -> int:
        """The index of ``call`` in :attr:`calls`."""
        return self.positions[call]

    @functools.cached_property
    def positions(self) -> dict[CallId, int]:
        return {c: i for i, c in enumerate(self.calls)}


def leaf_map(obj: Any, fn: Callable[[int, torch.Tensor], Any]) -> Any:
    """``obj`` with its ``i``-th tensor replaced by ``fn(i, tensor)``, in :func:`tensors_in` order."""
    counter = iter(range(1 << 62))
    return map_structure(obj, lambda leaf: fn(next(counter), leaf) if isinstance(leaf, torch.Tensor) else leaf)


class _Labels(TorchFunctionMode):
    """Carries labels (unit outputs, parameters) from the inputs of every torch operation to its outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.of_tensor: WeakIdKeyDictionary = WeakIdKeyDictionary()
        #: inside a unit call: its internal operations need no labels (the unit's outputs get fresh ones)
        self.depth = 0
        #: the labels of the operation that needed a fake tensor's values, and the operation
        self.failed: tuple[frozenset, str] | None = None

    def of(self, obj: Any) -> frozenset:
        found: frozenset = frozenset()
        for t in tensors_in(obj):
            found = found | self.of_tensor.get(t, frozenset())
        return found

    def label(self, obj: Any, labels: frozenset) -> None:
        for t in tensors_in(obj):
            self.of_tensor[t] = self.of_tensor.get(t, frozenset()) | labels

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.depth:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        try:
            out = func(*args, **kwargs)
        except torch_compat.data_dependent_errors():
            self.failed = (self.of((args, kwargs)), name)
            raise
        # Factories that copy only a shape (`zeros_like`, `new_ones`) do not depend on their template's values.
        if name in _SHAPE_ONLY or name.startswith("new_"):
            return out
        labels = self.of((args, kwargs))
        if labels:
            self.label(out, labels)
            if name.endswith("_") or name.startswith("__i") or name == "__setitem__":  # in place: the target too
                self.label(args[:1], labels)
            self.label(kwargs.get("out"), labels)
        return out


def plan_routes(
    skeleton: nn.Module,
    units: Mapping[str, nn.Module],
    owner: Mapping[str, int],
    num_stages: int,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    probe: Callable[[nn.Module, tuple, dict], Any],
) -> RoutePlan:
    """Run ``skeleton(*args, **kwargs)`` once, labelling unit outputs, and route them (see the module docstring).

    ``units`` maps each unit's name to its module in ``skeleton`` (one name per module), ``owner`` each unit to its
    stage. ``probe(unit, args, kwargs)`` gives the outputs of a unit that cannot run on fake tensors (its own code
    reads values: a mixture-of-experts dispatch). Raises ``PipelineModelError`` for a value no route can carry.
    """
    labels = _Labels()
    names = {id(module): name for name, module in units.items()}
    needs: dict[CallId, frozenset] = {}
    outputs: dict[CallId, Any] = {}
    calls: list[CallId] = []
    probed: list[str] = []
    counts: dict[str, int] = {}
    holders: dict[int, list[str]] = {}
    for name, module in units.items():
        for param in module.parameters():
            holders.setdefault(id(param), []).append(name)
    for name, module in units.items():
        for pname, param in module.named_parameters():
            labels.label(param, frozenset({_Param(f"{name}.{pname}", tuple(holders[id(param)]))}))

    def run_unit(module: nn.Module, original: Callable[..., Any], *a: Any, **k: Any) -> Any:
        name = names[id(module)]
        call = (name, counts.get(name, 0))
        counts[name] = call[1] + 1
        calls.append(call)
        needs[call] = labels.of((a, k))
        containers = _containers((a, k))
        labels.depth += 1
        try:
            try:
                out = original(*a, **k)
            except torch_compat.data_dependent_errors():
                # The unit's own code reads values (a mixture-of-experts dispatch): its outputs' shapes come from
                # running it on zero weights, with its instance forward (this wrapper) out of the way.
                wrapper = module.__dict__.pop("forward")
                try:
                    out = probe(module, a, k)
                finally:
                    module.forward = wrapper
                probed.append(name)
        finally:
            labels.depth -= 1
        for path, container, state in containers:
            if _state(container) != state:
                raise _mutated(name, path, owner[name])
        out = leaf_map(out, lambda i, t: t.detach())
        outputs[call] = out
        for i, t in enumerate(tensors_in(out)):
            labels.of_tensor[t] = frozenset({(call[0], call[1], i)})
        return out

    restore = _wrap_units(units.values(), run_unit)
    try:
        with labels:
            result = skeleton(*args, **kwargs)
    except torch_compat.data_dependent_errors() as err:
        raise _glue_reads_values(labels.failed, err, owner) from None
    finally:
        restore()
    needs[(OUTPUT, 0)] = labels.of(result)
    sends, last_call = _route(calls, needs, owner, num_stages)
    trainable = {name for name, module in units.items() if any(p.requires_grad for p in module.parameters())}
    off = off_input(calls, needs, owner, num_stages, trainable)
    return RoutePlan(
        tuple(calls), outputs, sends, last_call, tuple(dict.fromkeys(probed)), off, len(tensors_in(result))
    )


def _containers(obj: Any, path: str = "", depth: int = 0) -> list[tuple[str, Any, tuple]]:
    """The lists, dicts and sets in a unit's arguments (``path``, the object, its state), to see which it changes."""
    found: list[tuple[str, Any, tuple]] = []
    if depth > 3:
        return found
    if isinstance(obj, (list, dict, set)):
        found.append((path, obj, _state(obj)))
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        found += _containers(value, f"{path}[{key!r}]", depth + 1)
    return found


def _state(container: Any) -> tuple:
    if isinstance(container, dict):
        return tuple((k, id(v)) for k, v in container.items())
    return tuple(sorted(map(id, container))) if isinstance(container, set) else tuple(map(id, container))


def _wrap_units(modules: Any, run_unit: Callable[..., Any]) -> Callable[[], None]:
    """Make every unit's call go through ``run_unit`` (the skeleton is the planner's own copy); returns the undo."""
    wrapped = []
    for module in modules:
        original = module.forward

        def forward(*a: Any, _module: nn.Module = module, _original: Any = original, **k: Any) -> Any:
            return run_unit(_module, _original, *a, **k)

        module.forward = forward
        wrapped.append(module)

    def restore() -> None:
        for module in wrapped:
            module.__dict__.pop("forward", None)

    return restore


def _route(
    calls: Sequence[CallId], needs: Mapping[CallId, frozenset], owner: Mapping[str, int], num_stages: int
) -> tuple[tuple[tuple[Key, ...], ...], tuple[int, ...]]:
    """The unit outputs crossing each boundary, and each stage's last unit call."""
    position = {c: i for i, c in enumerate(calls)}
    farthest: dict[Key, int] = {}
    for consumer, found in needs.items():
        stage = num_stages - 1 if consumer[0] == OUTPUT else owner[consumer[0]]
        for label in found:
            if isinstance(label, _Param):
                if stage not in {owner[u] for u in label.units}:
                    raise _parameter_outside(label, consumer, stage, owner)
                continue
            source = owner[label[0]]
            if stage < source:
                raise _backwards(label, source, consumer, stage)
            if stage > source:
                farthest[label] = max(farthest.get(label, stage), stage)
    sends = tuple(
        tuple(
            sorted(
                (k for k, far in farthest.items() if owner[k[0]] <= b < far),
                key=lambda k: (position[(k[0], k[1])], k[2]),
            )
        )
        for b in range(num_stages - 1)
    )
    last = [-1] * num_stages
    for i, (unit, _) in enumerate(calls):
        last[owner[unit]] = i
    return sends, tuple(last)


def off_input(
    calls: Sequence[CallId],
    needs: Mapping[CallId, frozenset],
    owner: Mapping[str, int],
    num_stages: int,
    trainable: set[str],
) -> tuple[bool, ...]:
    """Per stage: whether a trainable unit of the stage (after the first) runs on nothing the stage received, not
    even through its other units.

    torch's split backward (the zero-bubble schedules) computes a stage's input gradients first and its weight
    gradients later from the graph between the stage's inputs and its parameters; a weight whose output does not
    depend on any input (an embedding of a side input on a middle stage) is missing from that graph, and its gradient
    is lost or wrong (measured with torch 2.13: ``None`` in ZBVZeroBubble and InterleavedZeroBubble, a wrong value in
    DualPipeV). Such stages run whole backward passes instead.
    """
    reached: set[CallId] = set()
    off = [False] * num_stages
    for call in calls:
        stage = owner[call[0]]
        sources = [label for label in needs[call] if not isinstance(label, _Param)]
        if any(owner[label[0]] < stage or (label[0], label[1]) in reached for label in sources):
            reached.add(call)
        elif stage > 0 and call[0] in trainable:
            off[stage] = True
    return tuple(off)


# ------------------------------------------------------------------------------------------------ errors
def _who(consumer: CallId) -> str:
    return OUTPUT if consumer[0] == OUTPUT else f"unit `{consumer[0]}`" + (f" (call {consumer[1] + 1})" * consumer[1])


def _backwards(label: Key, source: int, consumer: CallId, stage: int) -> PipelineModelError:
    return PipelineModelError(
        f"{_who(consumer)} (pipeline stage {stage}) reads output {label[2]} of unit `{label[0]}`, which stage {source}"
        " holds: values travel only to later stages, so every unit must run after the units whose outputs it reads."
        " The units are placed in definition order: define the modules in the order the forward runs them (or name"
        f" the block stacks in that order with `blocks=[...]`), or move `{label[0]}` into the same unit. See {DOCS}."
    )


def _mutated(unit: str, path: str, stage: int) -> PipelineModelError:
    where = path.replace("(", "").replace(")", "")
    return PipelineModelError(
        f"Unit `{unit}` (pipeline stage {stage}) changes the list or dict it receives as argument {where} (appends to"
        " it, sets an entry): on the other stages that unit does not run, so they would read that object without the"
        " change. Only what a unit returns travels between stages: return the value from the unit's forward instead"
        f" (for transformers models, pass `use_cache=False`). See {DOCS}."
    )


def _parameter_outside(label: _Param, consumer: CallId, stage: int, owner: Mapping[str, int]) -> PipelineModelError:
    stages = sorted({owner[u] for u in label.units})
    return PipelineModelError(
        f"{_who(consumer)} (pipeline stage {stage}) is computed from parameter `{label.name}` read outside its unit"
        f" (held by stage {', '.join(map(str, stages))}): parameters do not travel between stages, only what units"
        f" return does. Call the unit (e.g. `self.{label.units[0]}(x)`) instead of using its weight in the forward,"
        f" or tie the weight to a module of stage {stage} (as a tied head does). See {DOCS}."
    )


def _glue_reads_values(
    failed: tuple[frozenset, str] | None, err: BaseException, owner: Mapping[str, int]
) -> PipelineModelError:
    found = sorted({label[0] for label in failed[0] if not isinstance(label, _Param)}) if failed else []
    where = _user_frame(err)
    source = f" computed from unit(s) {', '.join(f'`{u}` (stage {owner[u]})' for u in found[:4])}" if found else ""
    return PipelineModelError(
        f"The network's forward reads the values of a tensor{source} outside any unit"
        f"{f' ({failed[1]})' if failed else ''}{where}: an `if` on a tensor, `.item()`, `.tolist()`, or a shape"
        " that depends on values. Every stage runs the forward, and a stage that does not hold those units does not"
        " have the value. Move that code into a unit's forward (a submodule with parameters that the pipeline"
        " places whole), compute it from the network's input only, or use `frontend='modules'`. See"
        f" {DOCS}.\nThe error was: {type(err).__name__}: {err}"
    )


def _user_frame(err: BaseException) -> str:
    """`` at file:line (`code`)`` of the innermost frame outside torch and lightning-pipe, if any."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(_LIBRARIES)]
    if not frames:
        return ""
    frame = frames[-1]
    code = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
    return f" at {frame.filename}:{frame.lineno} (`{code}`)"
