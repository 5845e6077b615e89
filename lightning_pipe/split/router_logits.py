"""Mixture-of-experts router logits carried to the last stage, so transformers' load-balancing loss sees every layer.

transformers mixture-of-experts models (Mixtral, Qwen3-MoE, ...) called with ``output_router_logits=True`` record the
router logits of every MoE layer while the base model runs, and the task model's forward computes the auxiliary
load-balancing loss from all of them (``load_balancing_loss_func``) and adds it to the loss. A stage runs only its own
layers, so each stage before the last sends its layers' logits, after the ones it received, with the hidden states;
the last stage puts the received logits before its own in the base model's output. The task model then computes the
loss with its own function from every layer's logits: the loss, its gradient to every router (the logits' gradients
travel back like the hidden states') and the output's ``router_logits`` are what one device computes for the
microbatch.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from lightning_pipe.compat.transformers import recorded_by
from lightning_pipe.errors import PipelineModelError, PipelineUsageError

ROUTER_LOGITS = "router_logits"
_local_routers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def requested(view: nn.Module, call: Mapping[str, Any]) -> bool:
    """Whether the call asks for the router logits (its ``output_router_logits``, else the model config's)."""
    flag = call.get("output_router_logits")
    return bool(getattr(getattr(view, "config", None), "output_router_logits", False) if flag is None else flag)


def stage_output(
    view: nn.Module, call: Mapping[str, Any], hidden: Tensor, outputs: Any, carried: tuple[Tensor, ...]
) -> Tensor | tuple[Tensor, ...]:
    """What a stage before the last sends: its hidden states, then the router logits received and its own."""
    if not requested(view, call):
        return hidden
    if not isinstance(outputs, Mapping):
        raise PipelineUsageError(
            f"{type(view).__name__} was called with `output_router_logits=True` and `return_dict=False`: a stage cannot"
            " find its layers' router logits in a tuple. Call the model with `return_dict=True` (the default)."
        )
    own = tuple(outputs.get(ROUTER_LOGITS) or ())
    _check_count(view, own)
    return (hidden, *carried, *own)


@contextmanager
def prepended(view: nn.Module, base: nn.Module, call: Mapping[str, Any], carried: tuple[Tensor, ...]) -> Iterator[None]:
    """On the last stage: the base model's output lists the ``carried`` router logits before this stage's own."""
    if not requested(view, call):
        yield
        return

    def prepend(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        own = tuple(output.get(ROUTER_LOGITS) or ()) if isinstance(output, Mapping) else ()
        _check_count(view, own)
        if carried:
            output[ROUTER_LOGITS] = (*carried, *own)
        return output

    handle = base.register_forward_hook(prepend, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _check_count(view: nn.Module, own: tuple[Tensor, ...]) -> None:
    """Refuse a family that records router logits in a way this carry does not see: every MoE layer the stage holds
    must have given one tensor, or the loss would silently miss layers."""
    expected = _local_routers.get(view)
    if expected is None:
        classes = recorded_by(view, ROUTER_LOGITS)
        expected = -1 if classes is None else sum(isinstance(m, classes) for m in view.modules())
        _local_routers[view] = expected
    if expected >= 0 and expected != len(own):
        raise PipelineModelError(
            f"{type(view).__name__} holds {expected} mixture-of-experts layers on this pipeline stage but its forward"
            f" recorded {len(own)} router logits: this transformers version records them in a way lightning-pipe"
            " does not carry between stages, so the load-balancing loss would miss layers. Pass"
            " `output_router_logits=False` (and add the auxiliary loss yourself), or use another transformers version."
        )
