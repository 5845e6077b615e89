"""The items a transformers model's own loss averages over, counted while the last stage computes it.

A task model called with ``labels=`` computes its loss with ``self.loss_function``; for causal LM (vision-language
models included), masked LM and token classification that is a cross-entropy averaged over the labels that are not
``ignore_index`` (causal LM: after the shift by one, or over ``shift_labels``). One microbatch's loss is therefore the
mean over *its* labelled items, and averaging the microbatches' means weights rows unlike one device's mean over the
batch. While the last stage runs a microbatch, :func:`counting` puts a wrapper in place of that function which
records each loss it returns with the number of items it averaged. The step protocol then weights the microbatch by
that count when the step returns exactly that loss (as if the step had returned ``num_items``): the batch's loss and
gradients are one device's mean over the batch's items on every transformers version, without
``num_items_in_batch`` (which every model would have to pass on to its loss).

Nothing is recorded (and the step is weighted as before) for a model whose forward computes its loss another way, a
loss function of one's own, or a call that passes ``num_items_in_batch`` itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from lightning_pipe.compat import transformers as tf_compat


@dataclass(frozen=True)
class Counted:
    """A loss the model's own loss function returned, and the number of items it is the mean over."""

    loss: torch.Tensor
    items: torch.Tensor


@contextmanager
def counting(body: nn.Module, candidates: Sequence[nn.Module] | None = None) -> Iterator[list[Counted]]:
    """Within the block, every token-mean loss the transformers models in ``body`` compute is recorded in the list
    yielded (nothing for other modules). ``candidates``: :func:`loss_candidates` of ``body``, found once by the caller
    (a stage's modules do not change after the split) instead of walking ``body`` on every call."""
    seen: list[Counted] = []
    with ExitStack() as stack:
        for model in _task_models(loss_candidates(body) if candidates is None else candidates):
            fn = model.loss_function
            shifts = tf_compat.token_mean_losses().get(fn)
            if shifts is not None:
                stack.callback(tf_compat.replace_loss_function(model, _recording(fn, shifts, seen)))
        yield seen


def items_of(loss: Any, seen: list[Counted]) -> torch.Tensor | None:
    """The number of items ``loss`` averages over when it is one of the losses recorded, else ``None``."""
    for counted in seen:
        if counted.loss is loss:
            return counted.items
    return None


def loss_candidates(body: nn.Module) -> list[nn.Module]:
    """The modules of ``body`` whose class has a ``loss_function`` property (transformers models): none in a plain
    network, whose stages then record nothing at no cost."""
    return [m for m in body.modules() if isinstance(getattr(type(m), "loss_function", None), property)]


def _task_models(candidates: Sequence[nn.Module]) -> list[nn.Module]:
    # `loss_type` is set by PreTrainedModel's constructor; the base model's is None (reading its `loss_function` would
    # log transformers' warning about an unknown loss type).
    return [m for m in candidates if getattr(m, "loss_type", None) is not None or tf_compat.has_own_loss_function(m)]


def _recording(fn: Callable[..., Any], shifts: bool, seen: list[Counted]) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    def loss_function(*args: Any, **kwargs: Any) -> Any:
        loss = fn(*args, **kwargs)
        items = _items(signature, shifts, args, kwargs)
        if items is not None and isinstance(loss, torch.Tensor):
            seen.append(Counted(loss, items))
        return loss

    return loss_function


def _items(signature: inspect.Signature, shifts: bool, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """What ``fn(*args, **kwargs)`` averages over: its labels that are not ``ignore_index`` (shifted by one for a
    causal LM, or ``shift_labels``); ``None`` when the call passes ``num_items_in_batch`` (the loss is then a sum over
    the microbatch divided by the caller's count) or no labels."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(name, {}))
    labels = named.get("labels")
    if labels is None or named.get("num_items_in_batch") is not None:
        return None
    ignore_index = named.get("ignore_index", -100)
    target = named.get("shift_labels") if shifts else None
    if target is None:
        target = labels[..., 1:] if shifts else labels
    return (target != ignore_index).sum().detach()
