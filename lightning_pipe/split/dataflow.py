"""The dataflow frontend (``frontend="dataflow"``): the network's forward runs unchanged on every stage, and each
value a unit computes travels to the stages whose units read it.

Networks whose later units read values computed much earlier (an encoder's output read by every decoder layer, a
U-Net's skip connections, mixture-of-experts terms summed at the end) cannot pass one activation from stage to stage.
Here every stage runs the network's own forward with the microbatch's own call:

- the units it holds run for real;
- a unit another stage holds is a :class:`StandIn`: it returns that unit's outputs as received from the stage that
  computed them, or, where this stage does not need them, fake tensors (shape, no data) from the route plan;
- the code between units (the *glue*) runs on every stage, on real values where they are real;
- a stage before the last stops right after its last unit call and sends the unit outputs that later stages read
  (:mod:`lightning_pipe.split.routing` decides which, once per call signature, on every rank alike).

The network needs no change: no ``None`` checks, no activation in place of its input. What it must not do outside
its units is read the values of a tensor computed by units (``.item()``, ``if t.any()``) or use another stage's
parameters; those are refused with the place and the fix.
"""

from __future__ import annotations

import contextvars
import copy
import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from lightning_pipe.compat import torch as torch_compat
from lightning_pipe.errors import PipelineModelError, PipelineUsageError
from lightning_pipe.models import kind_of
from lightning_pipe.models.base import Placeholder
from lightning_pipe.models.units import CONTAINERS, Layout, find_stacks, find_stacks_layout, ordered_layout
from lightning_pipe.split.routing import DOCS, OUTPUT, Key, RoutePlan, leaf_map, plan_routes
from lightning_pipe.split.surgery import STANDS_IN
from lightning_pipe.structures import map_structure, tensors_in

#: route plans kept per stage call (one per call signature and mode, like the schedules the executor keeps)
_MAX_PLANS = 16
#: the run of the stage call in progress (the stand-ins answer from it)
_ACTIVE: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("lightning_pipe_dataflow_run", default=None)


#: a stand-in's plain attributes (named so that they cannot hide an attribute of the unit it stands in for)
_UNIT, _SKELETON = "lightning_pipe_unit", "lightning_pipe_skeleton"


class _StageDone(BaseException):
    """Ends a stage's forward after its last unit call (a BaseException: ``except Exception`` cannot swallow it)."""


class StandIn(nn.Module):
    """Stands in for a unit that another pipeline stage holds (see the module docstring).

    While a stage runs, attributes it does not have are read from the unit's skeleton (a copy with fake
    parameters), so glue that inspects a unit (``self.layers[0].self_attn.batch_first``) reads what it would on one
    device. Outside a stage's run it is an empty module.
    """

    def __init__(self, unit: str, skeleton: nn.Module) -> None:
        super().__init__()
        # Plain attributes: the skeleton is not a submodule (its fake parameters belong to no state dict).
        self.__dict__[_UNIT] = unit
        self.__dict__[_SKELETON] = skeleton

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if _ACTIVE.get() is None or name.startswith("__") or self.__dict__.get(_SKELETON) is None:
                raise
        skeleton = self.__dict__[_SKELETON]
        value = getattr(skeleton, name)
        if isinstance(value, torch.Tensor) and not any(value is t for t in _own_tensors(skeleton)):
            raise _stashed_tensor(self.__dict__[_UNIT], name, _ACTIVE.get())
        return value

    def __getstate__(self) -> dict[str, Any]:
        # Pickled (a network kept in `save_hyperparameters()`, `torch.save(model)`), a stand-in is an empty module:
        # fake tensors do not pickle, and a copy runs no stage.
        return {**self.__dict__, _SKELETON: None}

    def __deepcopy__(self, memo: dict[int, Any]) -> StandIn:
        # A deep copy (EMA/SWA callbacks copy the LightningModule) shares the skeleton: fake tensors, never written.
        copied = StandIn.__new__(StandIn)
        memo[id(self)] = copied
        state = {key: value for key, value in self.__dict__.items() if key != _SKELETON}
        copied.__dict__.update(copy.deepcopy(state, memo))
        copied.__dict__[_SKELETON] = self.__dict__[_SKELETON]
        return copied

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        run, unit = _ACTIVE.get(), self.__dict__[_UNIT]
        if run is None:
            raise PipelineUsageError(
                f"Unit `{unit}` is held by another pipeline stage; it runs only inside the strategy's steps."
            )
        return run.absent(unit)

    def extra_repr(self) -> str:
        return f"stands in for {self.__dict__[_UNIT]}"


setattr(StandIn, STANDS_IN, True)


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def skeleton_of(network: nn.Module, mode: Any, device: torch.device) -> nn.Module:
    """A deep copy of ``network`` whose parameters and buffers are fake tensors on ``device`` (no memory)."""
    memo: dict[int, Any] = {}
    with mode:
        for t in _own_tensors(network):
            fake = torch.empty(t.shape, dtype=t.dtype, device=device)
            memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
    try:
        return copy.deepcopy(network, memo)
    except (TypeError, RuntimeError, AttributeError) as err:
        raise PipelineModelError(
            f"`frontend='dataflow'` copies {type(network).__name__} with fake parameters to plan its routes, and the"
            f" copy failed ({type(err).__name__}: {err}). Keep objects that cannot be deep-copied (open files, process"
            " groups, locks) out of the network's attributes, or use `frontend='modules'`."
        ) from err


def _plan_key(args: tuple, kwargs: Mapping[str, Any]) -> tuple:
    """What the route plan may depend on: tensor shapes, dtypes and devices, and plain values, in call order."""
    parts: list[Any] = []

    def visit(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            parts.append((tuple(leaf.shape), leaf.dtype, leaf.device.type))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            parts.append(leaf)
        else:
            parts.append(type(leaf).__qualname__)
        return leaf

    map_structure((args, dict(kwargs)), visit)
    return tuple(parts)


class DataflowCall:
    """The stage call of ``frontend="dataflow"`` (a :data:`~lightning_pipe.models.base.StageCall`).

    Made with the skeleton before the network is cut; :meth:`bind` gives it the stages once they exist. It keeps one
    route plan per call signature and training mode.
    """

    def __init__(
        self,
        skeleton: nn.Module,
        mode: Any,
        canonical: Mapping[str, str],
        device: torch.device,
        prepare: Callable[[nn.Module, tuple, dict], tuple[tuple, dict]] | None = None,
    ) -> None:
        self.skeleton, self.mode, self.device = skeleton, mode, device
        #: every unit name (aliases included) -> the unit's first name
        self.canonical = dict(canonical)
        self.prepare = prepare
        self.owner: dict[str, int] = {}
        self.num_stages = 0
        self.network: nn.Module | None = None
        self._stage_of: dict[int, int] = {}
        self._local: dict[int, dict[str, nn.Module]] = {}
        self._plans: OrderedDict[tuple, RoutePlan] = OrderedDict()
        #: stages that run whole backward passes under some plan made so far (kept when the plan is evicted)
        self._needs_whole_backward: set[int] = set()
        #: received tensors whose gradients are made contiguous
        self._hooked: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def bind(
        self, units_per_stage: Sequence[Sequence[str]], bodies: Mapping[int, nn.Module], network: nn.Module
    ) -> None:
        """The stage of every unit, this rank's stage bodies and the (cut) network whose training mode plans use."""
        self.owner = {self.canonical[u]: s for s, units in enumerate(units_per_stage) for u in units}
        self.num_stages = len(units_per_stage)
        self.network = network
        self._stage_of = {id(body): s for s, body in bodies.items()}
        self._local = {
            s: {u: body.get_submodule(u) for u in dict.fromkeys(self.canonical[n] for n in units_per_stage[s])}
            for s, body in bodies.items()
        }

    def plan(self, args: tuple, kwargs: Mapping[str, Any]) -> RoutePlan:
        """The route plan of this call signature (made on first use: one fake forward of the whole network)."""
        training = bool(self.network.training) if self.network is not None else False
        key = (training, _plan_key(args, kwargs))
        plan = self._plans.get(key)
        if plan is None:
            self.skeleton.train(training)
            units = {u: self.skeleton.get_submodule(u) for u in self.owner}
            plan = plan_routes(self.skeleton, units, self.owner, self.num_stages, args, dict(kwargs), self._probe)
            self._plans[key] = plan
            self._needs_whole_backward |= {s for s, off in enumerate(plan.off_input) if off}
            if len(self._plans) > _MAX_PLANS:
                self._plans.popitem(last=False)
        self._plans.move_to_end(key)
        return plan

    def describe_failure(self, stage: int) -> str:
        """What an error raised inside ``stage`` should be read with (a note the stage adapter adds)."""
        absent = [u for u, s in self.owner.items() if s != stage]
        shown = ", ".join(absent[:8]) + (" ..." if len(absent) > 8 else "")
        return (
            "With `frontend='dataflow'` every stage runs the network's whole forward on the microbatch's own"
            f" arguments; the units other stages hold ({shown}) are stand-ins that return their outputs as received,"
            f" or shapes without values where this stage does not read them. See {DOCS}."
        )

    def full_backward(self, stage: int) -> bool:
        """Whether ``stage`` must run whole backward passes (:func:`~lightning_pipe.split.routing.off_input`) under
        the routes planned so far (every plan is made in the first forward of its signature, before any backward)."""
        return stage in self._needs_whole_backward

    def __call__(
        self, body: nn.Module, args: tuple, kwargs: dict, received: tuple | None, is_first: bool, is_last: bool
    ) -> Any:
        stage = self._stage_of[id(body)]
        if self.prepare is not None:
            args, kwargs = self.prepare(body, args, kwargs)
        plan = self.plan(args, kwargs)
        for t in received or ():
            if t.requires_grad and t not in self._hooked:
                # torch allocates the previous stage's gradient buffers with the strides of the gradient computed
                # here (its metadata inference); communication needs them contiguous, and a value read through a
                # transpose (attention over an encoder's output) gets a strided gradient. torch reuses its receive
                # buffers step after step: one hook each.
                t.register_hook(_contiguous)
                self._hooked[t] = True
        run = _Run(plan, stage, self.owner, received or (), is_last)
        handles = []
        for unit, module in self._local[stage].items():
            handles.append(module.register_forward_pre_hook(run.before_local(unit), with_kwargs=True))
            handles.append(module.register_forward_hook(run.after_local(unit), with_kwargs=True))
        token = _ACTIVE.set(run)
        try:
            try:
                output = body(*args, **kwargs)
            except _StageDone:
                output = None
        finally:
            _ACTIVE.reset(token)
            for handle in handles:
                handle.remove()
        return run.finish(output)

    def _probe(self, unit: nn.Module, args: tuple, kwargs: dict) -> Any:
        """The outputs (as fakes) of a unit that cannot run on fake tensors: run it on zero weights and zero inputs."""

        def real(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros(t.shape, dtype=t.dtype, device=self.device) if torch_compat.is_fake(t) else t

        state = {name: real(t) for name, t in itertools.chain(unit.named_parameters(), unit.named_buffers())}
        try:
            with torch.no_grad():
                out = torch.func.functional_call(
                    unit, state, leaf_map(args, lambda i, t: real(t)), leaf_map(kwargs, lambda i, t: real(t))
                )
        except Exception as err:  # the unit's own code on zeros: any error means the same to the user
            raise PipelineModelError(
                f"`frontend='dataflow'` needs the output shapes of every unit on every stage. {type(unit).__name__}"
                " reads its inputs' values (so it cannot run on fake tensors) and also failed on zero weights and"
                f" inputs ({type(err).__name__}: {err}). Use `frontend='modules'` for this network."
            ) from err
        return leaf_map(out, lambda i, t: self.mode.from_tensor(t))


class _Run:
    """One stage call in progress: the values it received, the unit outputs it produced, where it stops."""

    def __init__(self, plan: RoutePlan, stage: int, owner: Mapping[str, int], received: tuple, is_last: bool) -> None:
        self.plan, self.stage, self.owner, self.is_last = plan, stage, owner, is_last
        incoming = plan.sends[stage - 1] if stage > 0 else ()
        if len(received) != len(incoming):
            raise PipelineUsageError(
                f"Internal error: stage {stage} received {len(received)} values, its route plan expects"
                f" {len(incoming)}."
            )
        self.received: dict[Key, torch.Tensor] = dict(zip(incoming, received))
        self.counts: dict[str, int] = {}
        self.produced: dict[Key, tuple[torch.Tensor, int]] = {}
        self.stop_at = None if is_last else plan.last_call[stage]

    def _next(self, unit: str) -> tuple[str, int]:
        ordinal = self.counts.get(unit, 0)
        self.counts[unit] = ordinal + 1
        call = (unit, ordinal)
        if call not in self.plan.outputs:
            raise _another_path(call, self.stage)
        return call

    def absent(self, unit: str) -> Any:
        call = self._next(unit)
        return leaf_map(self.plan.outputs[call], lambda i, fake: self.received.get((*call, i), fake))

    def before_local(self, unit: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if any(torch_compat.is_fake(t) for t in tensors_in((args, kwargs))):
                raise _unroutable(f"unit `{unit}`", self.stage)

        return hook

    def after_local(self, unit: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            call = self._next(unit)
            for i, t in enumerate(tensors_in(output)):
                self.produced[(*call, i)] = (t, torch_compat.version(t))
            if self.plan.position(call) == self.stop_at:
                raise _StageDone

        return hook

    def finish(self, output: Any) -> Any:
        if self.is_last:
            tensors = tensors_in(output)
            if any(torch_compat.is_fake(t) for t in tensors) or len(tensors) != self.plan.output_tensors:
                raise _unroutable(OUTPUT, self.stage)
            return output
        values = []
        for key in self.plan.sends[self.stage]:
            if key in self.received:
                values.append(self.received[key])
                continue
            if key not in self.produced:
                raise _another_path(key[:2], self.stage)
            tensor, version = self.produced[key]
            if torch_compat.version(tensor) != version:
                raise PipelineModelError(
                    f"The network's forward changed output {key[2]} of unit `{key[0]}` in place after the unit"
                    f" returned (pipeline stage {self.stage}); the stages that read it receive the value the unit"
                    " returned and would apply that change again. Write the change out of place (`x = x + y`)."
                )
            values.append(tensor)
        return tuple(values)


# ------------------------------------------------------------------------------------------------ the frontend
def dataflow_layout(network: nn.Module, blocks: str | Sequence[str]) -> Layout:
    """The units of a network for the dataflow frontend: every block stack (:func:`find_stacks`) in one layout; a
    model kind's order where it knows one (a transformers model's pipeline plan: the order its forward runs)."""
    order = kind_of(network).dataflow_order(network) if blocks == "auto" else None
    if order:
        stacks = {name for name in order if isinstance(network.get_submodule(name), CONTAINERS)}
        units = [n for n in order if n in stacks or any(True for _ in network.get_submodule(n).parameters())]
        return ordered_layout(network, units, stacks)
    return find_stacks_layout(network, find_stacks(network, blocks))


def dataflow_frontend(network: nn.Module, layout: Layout, device: torch.device) -> tuple[Placeholder, DataflowCall]:
    """What stands in for absent units, and the stage call; made from the whole network, before it is cut."""
    prepare = kind_of(network).prepare_dataflow_call
    mode = torch_compat.fake_tensor_mode()
    skeleton = skeleton_of(network, mode, device)
    first_name: dict[int, str] = {}
    canonical = {}
    for unit in layout.units:
        canonical[unit] = first_name.setdefault(id(network.get_submodule(unit)), unit)
    stand_ins = {u: StandIn(u, skeleton.get_submodule(u)) for u in set(canonical.values())}
    call = DataflowCall(skeleton, mode, canonical, device, prepare)
    return (lambda unit: stand_ins[canonical[unit]]), call


# ------------------------------------------------------------------------------------------------ errors
def _unroutable(where: str, stage: int) -> PipelineModelError:
    return PipelineModelError(
        f"On pipeline stage {stage}, {where} would receive values this stage cannot compute: they come from units of"
        " other stages by a way lightning-pipe does not route (only what units return travels). Typical causes: a"
        " list or cache object that units fill in and the forward reads later (return the values from the units"
        " instead; for transformers models pass `use_cache=False`), or a branch on the batch's values that reads other"
        f" unit outputs than the first batch of this shape did. See {DOCS}."
    )


def _stashed_tensor(unit: str, name: str, run: _Run | None) -> PipelineModelError:
    stage = "" if run is None else f" on pipeline stage {run.stage}"
    return PipelineModelError(
        f"The network's forward reads `{unit}.{name}`{stage}, a tensor that unit `{unit}` keeps as an attribute, but"
        " another stage holds that unit: only what a unit returns travels between stages. Return the value from the"
        f" unit's forward (and combine it in the network's forward), or register it as a buffer. See {DOCS}."
    )


def _another_path(call: tuple[str, int], stage: int) -> PipelineModelError:
    return PipelineModelError(
        f"The network's forward took another path on pipeline stage {stage} than when its routes were planned: call"
        f" {call[1] + 1} of unit `{call[0]}` was not part of the plan. The forward must call the same units in the same"
        " order for every batch of one shape (no branches on the batch's values that choose units, no state that"
        f" changes which units run). See {DOCS}."
    )
