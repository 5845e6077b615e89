"""What one unit costs on one call: the single measurement behind ``balance="auto"`` and the tuner's cost model.

:func:`time_unit` runs a unit alone on one call: forward, full backward (input and weight gradients) and
input-gradient backward, each the fastest of ``repeats`` after one untimed run (other processes on the machine only
ever add time), and the bytes its forward saves for backward, takes in and passes on. The split's balance uses the
forward plus the full backward (:func:`lightning_pipe.split.balance.profile_units`), the tuner all of them
(:mod:`lightning_pipe.tune.profile`). Needs no process group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_pipe.measure.memory import SavedTensorBytes
from lightning_pipe.structures import map_tensors, tensors_in


@dataclass(frozen=True)
class UnitTimes:
    """One unit on one microbatch."""

    forward: float
    #: input and weight gradients in one backward
    backward: float
    #: input gradients only (the ``I`` half of a split backward); ``backward - backward_input`` is the ``W`` half
    backward_input: float
    #: bytes its forward saves for backward
    saved_bytes: int
    #: bytes of its floating-point inputs (all that a checkpointed block keeps)
    input_bytes: int
    #: bytes of its floating-point outputs (what crosses a stage boundary after it)
    output_bytes: int

    def times(self, calls: int) -> UnitTimes:
        """What a unit the network calls ``calls`` times per forward costs (its inputs and outputs are one call's)."""
        if calls == 1:
            return self
        return UnitTimes(
            self.forward * calls,
            self.backward * calls,
            self.backward_input * calls,
            self.saved_bytes * calls,
            self.input_bytes,
            self.output_bytes,
        )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _own(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def time_unit(
    unit: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    device: torch.device,
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> UnitTimes:
    """Forward, full backward and input-gradient backward seconds of ``unit`` on one call, each the fastest of
    ``repeats`` after one untimed warm-up, and its saved, input and output bytes. ``clock``: wall time by default;
    ``time.thread_time`` measures CPU time instead, which other processes on a shared CPU disturb far less (with one
    torch thread)."""
    # Own copies: a slice of the batch would count the whole batch's storage as saved for backward.
    args, kwargs = map_tensors(tuple(args), _own), map_tensors(dict(kwargs), _own)
    inputs = [t for t in tensors_in((args, kwargs)) if t.is_floating_point()]
    for t in inputs:
        t.requires_grad_(True)
    params = [p for p in unit.parameters() if p.requires_grad]
    own = [*unit.parameters(), *unit.buffers()]

    def forward() -> tuple[list[torch.Tensor], float]:
        sync(device)
        start = clock()
        with torch.enable_grad():
            out = [o for o in tensors_in(unit(*args, **kwargs)) if o.requires_grad]
        sync(device)
        return out, clock() - start

    def backward(out: list[torch.Tensor], wrt: list[torch.Tensor]) -> float:
        if not out or not wrt:
            return 0.0
        sync(device)
        start = clock()
        torch.autograd.grad(out, wrt, grad_outputs=[torch.ones_like(o) for o in out], allow_unused=True)
        sync(device)
        return clock() - start

    with torch.enable_grad(), SavedTensorBytes(exclude=own) as meter:
        out = [o for o in tensors_in(unit(*args, **kwargs)) if o.requires_grad]
    output_bytes = sum(o.numel() * o.element_size() for o in out if o.is_floating_point())
    backward(out, params + inputs)
    fwd, full, partial = [], [], []
    for _ in range(max(repeats, 1)):
        out, seconds = forward()
        fwd.append(seconds)
        full.append(backward(out, params + inputs))
        out, _ = forward()
        partial.append(backward(out, inputs))
    return UnitTimes(
        forward=min(fwd),
        backward=min(full),
        backward_input=min(min(partial), min(full)),
        saved_bytes=meter.bytes,
        input_bytes=sum(t.numel() * t.element_size() for t in inputs),
        output_bytes=output_bytes,
    )
