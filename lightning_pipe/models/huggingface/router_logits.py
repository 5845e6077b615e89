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
from contextlib import ExitStack, contextmanager
from typing import Any

from torch import Tensor, nn

from lightning_pipe.compat.transformers import recorded_by
from lightning_pipe.errors import PipelineModelError, PipelineUsageError

ROUTER_LOGITS = "router_logits"
_ROUTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def requested(view: nn.Module, call: Mapping[str, Any]) -> bool:
    """Whether the call asks for the router logits (its ``output_router_logits``, else the model config's)."""
    flag = call.get("output_router_logits")
    return bool(getattr(getattr(view, "config", None), "output_router_logits", False) if flag is None else flag)


class Carry:
    """The router logits of one stage call: those ``carried`` from earlier stages and the stage's own."""

    def __init__(self, view: nn.Module, call: Mapping[str, Any], carried: tuple[Tensor, ...], is_last: bool) -> None:
        self.view, self.carried, self.is_last = view, carried, is_last
        self.requested = requested(view, call)
        if call.get("return_dict") is False and self.requested:
            raise PipelineUsageError(
                f"{type(view).__name__} was called with `output_router_logits=True` and `return_dict=False`: a stage"
                " cannot find its layers' router logits in a tuple. Call the model with `return_dict=True` (the"
                " default)."
            )
        self.own: list[Tensor] = []

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Within the block, the stage's own router logits are recorded (a stage before the last leaves the forward
        early, so they are taken from its MoE modules) or, on the last stage, put after the carried ones."""
        if not self.requested:
            yield
            return
        self.own = []
        with ExitStack() as stack:
            if self.is_last:
                base = getattr(self.view, "base_model", self.view)
                stack.callback(base.register_forward_hook(self._prepend, with_kwargs=True).remove)
            else:
                for module, index in _local_routers(self.view):
                    record = lambda mod, args, out, i=index: self._record(out, i)  # noqa: E731
                    stack.callback(module.register_forward_hook(record).remove)
            yield

    def output(self, out: Any) -> Any:
        """What the stage returns: on a stage before the last, its hidden states and then every router logit."""
        if not self.requested or self.is_last:
            return out
        _check_count(self.view, len(self.own))
        return (out, *self.carried, *self.own)

    def _record(self, out: Any, index: int) -> None:
        self.own.append(out[index] if isinstance(out, tuple) else out)

    def _prepend(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        own = tuple(output.get(ROUTER_LOGITS) or ()) if isinstance(output, Mapping) else ()
        _check_count(self.view, len(own))
        if self.carried:
            output[ROUTER_LOGITS] = (*self.carried, *own)
        return output


def _local_routers(view: nn.Module) -> list[tuple[nn.Module, int]]:
    """The modules of this stage whose outputs transformers records as router logits, with the output's index (found
    once per stage view: its modules do not change)."""
    found = _ROUTERS.get(view)
    if found is None:
        spec = recorded_by(view, ROUTER_LOGITS)
        if spec is None:
            raise _uncounted(view, "its router logits are recorded by module names")
        found = _ROUTERS[view] = [(m, index) for m in view.modules() for cls, index in spec if isinstance(m, cls)]
    return found


def _check_count(view: nn.Module, recorded: int) -> None:
    """Refuse a family that records router logits in a way this carry does not see: every MoE layer the stage holds
    must have given one tensor, or the loss would silently miss layers."""
    expected = len(_local_routers(view))
    if expected != recorded:
        raise _uncounted(view, f"it holds {expected} mixture-of-experts layers on this stage but recorded {recorded}")


def _uncounted(view: nn.Module, why: str) -> PipelineModelError:
    return PipelineModelError(
        f"{type(view).__name__} records router logits in a way lightning-pipe does not carry between pipeline stages"
        f" ({why}), so the load-balancing loss would miss layers. Pass `output_router_logits=False` (and add the"
        " auxiliary loss yourself), or use another transformers version."
    )
