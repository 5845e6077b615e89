"""Measured costs per unit, and the split they imply: ``balance="auto"``, ``"params"`` and ``"blocks"``.

A pipeline step with ``M`` microbatches takes about ``M - 1`` times its slowest stage's microbatch, plus one
microbatch's pass through all stages and the first stage's optimizer step, so ``"auto"`` measures each unit's
(pre-units, each block, post-units) forward+backward time and parameters and splits the blocks to minimise that
(:func:`lightning_pipe.split.partition.balance_step_time`). The time comes from a short profiling pass: each unit alone,
on the process's own device, forward and backward on its input from one example microbatch, a few times after a
warm-up, the fastest of each (the one unit profiler, :func:`lightning_pipe.measure.profile.time_unit`, which the
tuner uses too). Parameters add the optimizer step's time per parameter; parameter bytes and activation bytes per
microbatch give each stage's memory, which the split can be held under (``memory_limit``) and which the split table
reports.

Profiling never touches the network's own tensors: each profiled unit is copied to the device (a unit on the meta
device is allocated there and filled with random weights), so a network built whole on the CPU for a CUDA run is
profiled on the GPU one unit at a time. Blocks of one kind are profiled once (:func:`profile_units`), so with a
meta-device network the pass allocates one block and the pre- and post-units, one at a time.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.measure.memory import format_bytes
from lightning_pipe.measure.profile import sync, time_unit
from lightning_pipe.models import kind_of
from lightning_pipe.models.units import Layout
from lightning_pipe.split.partition import (
    UnitCosts,
    balance_blocks,
    balance_by_cost,
    balance_step_time,
    unit_params,
)
from lightning_pipe.structures import map_tensors


@dataclass(frozen=True)
class UnitProfile:
    """What one unit costs per microbatch."""

    name: str
    params: int
    """Parameter count."""
    param_bytes: int
    """Bytes of parameters and buffers."""
    activation_bytes: int
    """Bytes saved for backward by one forward on one microbatch."""
    time_s: float
    """Forward plus backward of one microbatch, seconds (each the fastest of the repetitions)."""
    measured: bool
    """False when ``time_s`` was estimated from a representative block."""


@dataclass(frozen=True)
class CostModel:
    """How unit profiles become a stage's time per training step and its memory."""

    microbatches: int
    """Microbatches per step: each unit runs forward and backward this many times."""
    in_flight: int
    """Microbatches whose activations a stage holds at once (GPipe: all of them; 1F1B: at most the stage count)."""
    update_s_per_param: float = 0.0
    """Optimizer-step seconds per parameter (:func:`measure_update_time`); 0 leaves the optimizer out."""
    state_bytes_per_param_byte: float = 4.0
    """Memory per byte of parameters: the parameter, its gradient and two optimizer moments (Adam)."""

    def time(self, unit: UnitProfile) -> float:
        """Seconds the unit keeps its stage busy per step: its microbatches, then its optimizer step."""
        return self.microbatches * unit.time_s + self.update(unit)

    def update(self, unit: UnitProfile) -> float:
        return self.update_s_per_param * unit.params

    def memory(self, unit: UnitProfile) -> float:
        return self.state_bytes_per_param_byte * unit.param_bytes + self.in_flight * unit.activation_bytes

    def costs(
        self, profiles: Sequence[UnitProfile], layout: Layout, measure: Callable[[UnitProfile], float]
    ) -> UnitCosts:
        """``measure`` of each unit (e.g. ``lambda u: u.time_s``, :meth:`update`, :meth:`memory`), folded into
        :class:`UnitCosts` for the splitter."""
        by_name = {p.name: p for p in profiles}
        return UnitCosts(
            pre=sum(measure(by_name[u]) for u in layout.pre),
            blocks=tuple(sum(measure(by_name[u]) for u in layout.group(b)) for b in layout.blocks),
            post=sum(measure(by_name[u]) for u in layout.post),
        )

    def step_time(self, profiles: Sequence[UnitProfile], layout: Layout, counts: Sequence[int]) -> float:
        """Estimated step of a flush schedule (GPipe, 1F1B): one microbatch's pass through all stages, ``M - 1``
        times the slowest stage's microbatch, and the first stage's optimizer step."""
        per_microbatch = self.costs(profiles, layout, lambda u: u.time_s).stages(counts)
        first_update = self.costs(profiles, layout, self.update).stages(counts)[0]
        return sum(per_microbatch) + (self.microbatches - 1) * max(per_microbatch) + first_update


# -------------------------------------------------------------------------------------------------- profiling
def capture_unit_inputs(
    network: nn.Module, units: Sequence[str], args: Sequence[Any], kwargs: dict[str, Any]
) -> dict[str, tuple[tuple[Any, ...], dict[str, Any], int]]:
    """Run ``network(*args, **kwargs)`` once without gradients; return each unit's first ``(args, kwargs)`` and its
    number of calls. Units never called are missing."""
    found: dict[str, tuple[tuple[Any, ...], dict[str, Any], int]] = {}

    def hook(name: str) -> Any:
        def record(module: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
            first_a, first_kw, calls = found.get(name, (a, kw, 0))
            found[name] = (first_a, first_kw, calls + 1)

        return record

    handles = [network.get_submodule(u).register_forward_pre_hook(hook(u), with_kwargs=True) for u in units]
    try:
        with torch.no_grad():
            network(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return found


def unit_copy(unit: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``unit`` on ``device``; a meta unit gets random weights (the values only need to be finite)."""
    clone = copy.deepcopy(unit)
    if any(t.is_meta for t in (*clone.parameters(), *clone.buffers())):
        clone.to_empty(device=device)
        with torch.no_grad():
            for t in (*clone.parameters(), *clone.buffers()):
                if t.is_floating_point():
                    t.normal_(0.0, 0.02)
                else:
                    t.zero_()
        return clone
    return clone.to(device)


def _params(module: nn.Module) -> tuple[int, int]:
    params = list(module.parameters())
    count = sum(p.numel() for p in params)
    nbytes = sum(t.numel() * t.element_size() for t in (*params, *module.buffers()))
    return count, nbytes


def block_signature(module: nn.Module) -> tuple[Any, ...]:
    """Blocks with equal signatures (class, parameter and buffer shapes and dtypes) are assumed to cost the same."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return (type(module).__qualname__, tuple((n, tuple(t.shape), t.dtype) for n, t in tensors))


@dataclass(frozen=True)
class UnitCall:
    """How one unit is called on one microbatch, ready to be timed alone (:func:`unit_calls`)."""

    name: str
    params: int
    param_bytes: int
    #: times the network calls it per forward (0: never)
    calls: int
    #: an earlier block of the same :func:`block_signature` whose figures it shares (``None``: measure this one)
    same_as: str | None
    #: the unit's first call, as real tensors on the profiling device (empty when not measured)
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the unit itself (copied to the device by :meth:`copy`)
    module: nn.Module | None = None

    def copy(self, device: torch.device) -> nn.Module:
        """The unit on ``device`` (see :func:`unit_copy`)."""
        assert self.module is not None, "only measured units carry their module"
        return unit_copy(self.module, device)


def unit_calls(
    network: nn.Module, layout: Layout, args: Sequence[Any], kwargs: dict[str, Any], device: torch.device
) -> Iterator[UnitCall]:
    """The units of ``layout`` in order, each with its first call on one microbatch ``network(*args, **kwargs)``.

    Every pre- and post-unit is measured; of the blocks, the first of each :func:`block_signature` is, and the
    blocks like it share its figures (``same_as``): one block per kind keeps profiling short, and noise in the
    timings cannot make identical blocks look different. ``args``/``kwargs`` are real tensors (on any device) even
    when ``network`` is on the meta device: they fill the first units' inputs; inputs further in are found by
    running the network once (on the meta device if it is there) and are made real as random tensors of the same
    shape (integers: zeros) where they come from a meta network. The call is first made as the network's stages make
    it (the kind's ``prepare_profile_call``: a transformers model without its cache, which would grow with every
    timed call of a unit).
    """
    prepare = kind_of(network).prepare_profile_call
    if prepare is not None:
        args, kwargs = prepare(network, tuple(args), dict(kwargs))
    meta = any(t.is_meta for t in (*network.parameters(), *network.buffers()))
    net_device = torch.device("meta") if meta else next(network.parameters()).device
    real_of: dict[int, torch.Tensor] = {}

    def to_net(t: torch.Tensor) -> torch.Tensor:
        moved = t.to(net_device)
        real_of[id(moved)] = t
        return moved

    captured = capture_unit_inputs(
        network, layout.units, map_tensors(tuple(args), to_net), map_tensors(dict(kwargs), to_net)
    )

    def realise(t: torch.Tensor) -> torch.Tensor:
        if id(t) in real_of:
            return real_of[id(t)].detach().to(device)
        if not t.is_meta:
            return t.detach().to(device)
        if t.is_floating_point():
            return torch.randn(t.shape, dtype=t.dtype, device=device)
        return torch.zeros(t.shape, dtype=t.dtype, device=device)

    first_of_kind: dict[tuple[Any, ...], str] = {}
    for name in layout.units:
        module = network.get_submodule(name)
        count, nbytes = _params(module)
        if name not in captured:
            yield UnitCall(name, count, nbytes, 0, None)
            continue
        unit_args, unit_kwargs, calls = captured[name]
        rep = first_of_kind.setdefault(block_signature(module), name) if name in layout.blocks else name
        if rep != name:
            yield UnitCall(name, count, nbytes, calls, rep)
        else:
            real_args, real_kwargs = map_tensors(unit_args, realise), map_tensors(unit_kwargs, realise)
            yield UnitCall(name, count, nbytes, calls, None, real_args, real_kwargs, module)


def profile_units(
    network: nn.Module,
    layout: Layout,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    device: torch.device,
    *,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> list[UnitProfile]:
    """Profile the units of ``layout`` on ``device`` with one microbatch ``network(*args, **kwargs)``: forward plus
    full backward time and saved bytes of each, from the one unit profiler (:func:`lightning_pipe.measure.profile.
    time_unit`; see :func:`unit_calls`)."""
    profiles: dict[str, UnitProfile] = {}
    for call in unit_calls(network, layout, args, kwargs, device):
        if not call.calls:
            profiles[call.name] = UnitProfile(call.name, call.params, call.param_bytes, 0, 0.0, True)  # costs nothing
        elif call.same_as is not None:
            profiles[call.name] = dataclasses.replace(profiles[call.same_as], name=call.name, measured=False)
        else:
            unit = call.copy(device)
            times = time_unit(unit, call.args, call.kwargs, device, repeats, clock).times(call.calls)
            profiles[call.name] = UnitProfile(
                call.name, call.params, call.param_bytes, times.saved_bytes, times.forward + times.backward, True
            )
            del unit
    return [profiles[name] for name in layout.units]


def measure_update_time(
    device: torch.device, numel: int = 1 << 20, repeats: int = 3, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Seconds per parameter of an ``AdamW`` step on ``device`` (one tensor of ``numel`` parameters)."""
    param = torch.nn.Parameter(torch.zeros(numel, device=device))
    param.grad = torch.ones_like(param)
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    times = []
    for _ in range(repeats + 1):
        sync(device)
        start = clock()
        optimizer.step()
        sync(device)
        times.append(clock() - start)
    return statistics.median(times[1:]) / numel


# -------------------------------------------------------------------------------------------------- the split
def auto_balance(
    profiles: Sequence[UnitProfile],
    layout: Layout,
    num_stages: int,
    model: CostModel,
    *,
    memory_limit: float | None = None,
    empty_ends: bool = True,
) -> list[int]:
    """Blocks per stage minimising the estimated step time (:meth:`CostModel.step_time`), within ``memory_limit``
    bytes per stage (:meth:`CostModel.memory`)."""
    return balance_step_time(
        model.costs(profiles, layout, lambda u: u.time_s),
        model.costs(profiles, layout, model.update),
        num_stages,
        model.microbatches,
        memory=model.costs(profiles, layout, model.memory),
        memory_limit=memory_limit,
        empty_ends=empty_ends,
    )


def params_balance(network: nn.Module, layout: Layout, num_stages: int, *, empty_ends: bool = True) -> list[int]:
    """``balance="params"``: blocks per stage minimising the largest stage's parameter count (embedding and head
    included)."""
    return balance_by_cost(unit_params(network, layout), num_stages, empty_ends=empty_ends)


def blocks_balance(layout: Layout, num_stages: int) -> list[int]:
    """``balance="blocks"``: the even split by block count."""
    return balance_blocks(len(layout.blocks), num_stages)


def _describe(units: Sequence[str], layout: Layout) -> str:
    blocks = [u for u in units if u in layout.blocks]
    parts = [u for u in units if u in layout.pre]
    if len(blocks) > 2:
        parts.append(f"{blocks[0]}..{blocks[-1]} ({len(blocks)})")
    else:
        parts += blocks
    parts += [u for b in blocks for u in layout.group(b)[1:]]
    parts += [u for u in units if u in layout.post]
    return ", ".join(parts) or "-"


def split_table(
    layout: Layout,
    counts: Sequence[int],
    profiles: Sequence[UnitProfile] | None,
    model: CostModel | None,
    network: nn.Module | None = None,
) -> str:
    """The split as a text table: stage, units, parameters, estimated time per step, estimated memory.

    Without ``profiles`` (``balance`` other than ``"auto"``) the times and memory are ``-`` and the parameters are
    counted from ``network`` if given.
    """
    from lightning_pipe.split.partition import stage_units

    by_name = {p.name: p for p in profiles or ()}
    rows = [("stage", "units", "parameters", "est. time/step", "est. memory")]
    for s, units in enumerate(stage_units(layout, counts)):
        known = [by_name[u] for u in units if u in by_name]
        if profiles:
            params = f"{sum(p.params for p in known):,}"
        elif network is not None:
            params = f"{sum(_params(network.get_submodule(u))[0] for u in units):,}"
        else:
            params = "-"
        if model is not None and profiles:
            seconds = f"{sum(model.time(p) for p in known) * 1e3:.1f} ms"
            memory = format_bytes(sum(model.memory(p) for p in known))
        else:
            seconds = memory = "-"
        rows.append((str(s), _describe(units, layout), params, seconds, memory))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    if model is not None and profiles:
        lines.append(f"estimated step time (GPipe, 1F1B): {model.step_time(profiles, layout, counts) * 1e3:.1f} ms")
    return "\n".join(lines)


def resolve_balance(
    balance: str | Sequence[int],
    network: nn.Module,
    layout: Layout,
    num_stages: int,
    *,
    example: tuple[Sequence[Any], dict[str, Any]] | None,
    device: torch.device,
    model: CostModel | None,
    memory_limit: float | None = None,
) -> tuple[list[int], list[UnitProfile] | None]:
    """Blocks per stage for a ``balance`` setting, and the unit profiles when ``"auto"`` measured them.

    ``example``: the network call ``(args, kwargs)`` of one microbatch, needed by ``"auto"``. Every process
    measures its own times, so the caller must make all processes use one result (e.g. rank 0's, broadcast).
    """
    from lightning_pipe.split.partition import check_balance

    if not isinstance(balance, str):
        return check_balance(balance, len(layout.blocks), num_stages), None
    if balance == "blocks":
        return blocks_balance(layout, num_stages), None
    if balance == "params":
        return params_balance(network, layout, num_stages), None
    if balance != "auto":
        raise PipelineConfigError(
            f"`balance={balance!r}` is not one of 'auto', 'params', 'blocks' or a list of blocks per stage."
        )
    if example is None:
        raise PipelineConfigError(
            "`balance='auto'` profiles the network on one microbatch: set `self.example_input_array` in the"
            " LightningModule to one batch of network inputs, or use `balance='params'` or 'blocks'."
        )
    assert model is not None, "balance='auto' needs a cost model"
    profiles = profile_units(network, layout, example[0], example[1], device)
    return auto_balance(profiles, layout, num_stages, model, memory_limit=memory_limit), profiles
