"""Gradients across a pipeline: hand-over past Lightning's ``zero_grad``, data-parallel mean, global-norm clipping."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class GradientStash:
    """Holds the gradients one schedule step produced until Lightning's backward phase.

    Lightning calls ``training_step``, then ``zero_grad`` (at the start of an accumulation window), then ``backward``.
    The schedule computes gradients inside ``training_step``; this stash keeps them away from that ``zero_grad`` and
    adds them in ``backward``, which is what a single-device backward would have done.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[nn.Parameter, torch.Tensor]] = []

    @contextmanager
    def capture(self, params: Sequence[nn.Parameter]) -> Iterator[None]:
        previous = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
        finally:
            self._pending = [(p, p.grad) for p in params if p.grad is not None]
            for p, g in zip(params, previous):
                p.grad = g

    def release(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        pending, self._pending = self._pending, []
        return pending

    @staticmethod
    def apply(grads: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> None:
        for p, g in grads:
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)


def all_reduce_grads(grads: Sequence[torch.Tensor], group: Any | None, world: int) -> None:
    """Average gradients over data-parallel replicas, one flat buffer per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in tensors]).div_(world)
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def clip_grad_norm_across(params: Sequence[nn.Parameter], max_norm: float, group: Any | None) -> torch.Tensor:
    """Clip by the 2-norm of all gradients of all stages (this rank's part combined over ``group``)."""
    with_grad = [p for p in params if p.grad is not None]
    device = with_grad[0].grad.device if with_grad else torch.device("cpu")
    if with_grad:
        local = torch.nn.utils.get_total_norm([p.grad for p in with_grad], norm_type=2.0)
    else:
        local = torch.zeros((), device=device)
    squared = local.double().pow(2)
    if group is not None:
        dist.all_reduce(squared, group=group)
    total = squared.sqrt().to(local.dtype)
    if with_grad:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total)
    return total
