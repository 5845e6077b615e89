"""What each unit of the network costs: the measurements behind the tuner's cost model.

On one process (the tuner runs it on global rank 0 and sends the result to the others), for every microbatch size
the candidates use: the network's call is taken from the user's own ``training_step`` on a slice of the first real
batch (the step stops as the network is called), each unit's input is found by running the network once (on the meta
device when it was built there), and each unit alone, copied to the device, is timed by the one unit profiler
(:func:`lightning_pipe.measure.profile.time_unit`): forward, full backward, input-gradient backward; the bytes its
forward saves for backward, takes in and passes on.
Blocks of one kind are timed once (:func:`lightning_pipe.split.balance.unit_calls`).

Needs no process group. The user's model is not touched: the caller passes a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_pipe.errors import PipelineModelError
from lightning_pipe.measure.profile import UnitTimes, time_unit
from lightning_pipe.microbatch import batch_size, split_batch
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.split.balance import unit_calls
from lightning_pipe.split.builder import network_layout
from lightning_pipe.tune.cost import Profile


class _Called(Exception):
    """Raised by the hook on the network's call: the step has given what profiling needs."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


def network_call(lightning_module: Any, network: nn.Module, microbatch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments ``training_step`` passes to ``network`` for ``microbatch`` (the step is stopped right there)."""

    def stop(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        raise _Called(args, kwargs)

    handle = network.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with torch.no_grad():
            lightning_module.training_step(microbatch, 0)
    except _Called as called:
        return called.args, called.kwargs
    except Exception as err:  # the user's step, run outside a Trainer: any error means the same
        example = getattr(lightning_module, "example_input_array", None)
        if example is None:
            raise PipelineModelError(
                f"The tuner takes the network's input from `training_step` on the first batch, and the step failed"
                f" before calling the network outside a Trainer ({type(err).__name__}: {err}). Set"
                " `self.example_input_array` to one batch of network inputs, which the tuner then uses instead."
            ) from err
        first = split_batch(example, max(batch_size(example) // batch_size(microbatch), 1))[0]
        if isinstance(first, dict):
            return (), first
        return (tuple(first) if isinstance(first, (tuple, list)) else (first,)), {}
    finally:
        handle.remove()
    raise PipelineModelError(
        f"`training_step` of {type(lightning_module).__name__} did not call the network"
        f" ({type(network).__name__}) on the first batch, so the tuner cannot profile it. Check the strategy's"
        " `module` argument."
    )


def profile_network(
    lightning_module: Any,
    settings: PipelineSettings,
    batch: Any,
    sizes: Sequence[int],
    device: torch.device,
    *,
    repeats: int = 5,
) -> Profile:
    """Measure every unit of ``lightning_module``'s network at each microbatch size in ``sizes`` (samples), on
    slices of ``batch`` (one pipeline's batch)."""
    network, layout = network_layout(lightning_module, settings)
    total = batch_size(batch)
    times: dict[int, dict[str, UnitTimes]] = {}
    params: dict[str, int] = {}
    param_bytes: dict[str, int] = {}
    for size in sorted(set(sizes)):
        microbatch = split_batch(batch, total // size, size=total)[0]
        args, kwargs = network_call(lightning_module, network, microbatch)
        measured: dict[str, UnitTimes] = {}
        for call in unit_calls(network, layout, args, kwargs, device):
            params[call.name], param_bytes[call.name] = call.params, call.param_bytes
            if not call.calls:
                measured[call.name] = UnitTimes(0.0, 0.0, 0.0, 0, 0, 0)
            elif call.same_as is not None:
                measured[call.name] = measured[call.same_as]
            else:
                unit = call.copy(device)
                one = time_unit(unit, call.args, call.kwargs, device, repeats)
                measured[call.name] = one.times(call.calls)
                del unit
        times[size] = measured
    return Profile(layout, params, param_bytes, times, total)
