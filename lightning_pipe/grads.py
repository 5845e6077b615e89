"""Gradients across a pipeline: hand-over past Lightning's ``zero_grad``, data-parallel mean, global-norm clipping."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_pipe import collectives


class GradientStash:
    """Holds the gradients one schedule step produced until Lightning's backward phase.

    Lightning calls ``training_step``, then ``zero_grad`` (at the start of an accumulation window), then ``backward``.
    The schedule computes gradients inside ``training_step``; this stash keeps them away from that ``zero_grad`` and
    adds them in ``backward``, which is what a single-device backward would have done.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[nn.Parameter, torch.Tensor]] = []
        #: factor for the pending gradients (``1 / num_items`` of a token-weighted step), applied in :meth:`apply`
        self.scale: float | None = None

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

    def apply(self) -> None:
        """Add the pending gradients (scaled) to ``.grad``."""
        pending, self._pending = self._pending, []
        scale, self.scale = self.scale, None
        for p, g in pending:
            if scale is not None:
                g.mul_(scale)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)


@dataclass
class TiedCopy:
    """This rank's copy of a parameter that units of several stages share, and the group of the ranks holding one.

    ``source`` (a global rank) holds the parameter under its first name: its value is the one all copies start from,
    and only it counts the parameter in the gradient norm.
    """

    param: nn.Parameter
    group: Any
    source: int

    def agree(self) -> None:
        """Give every copy the source's value (after initialisation or loading)."""
        with torch.no_grad():
            collectives.broadcast_(self.param.data, self.source, self.group)

    def sum_gradients(self) -> None:
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param)
        collectives.all_reduce_(self.param.grad, self.group)


class GradientSync:
    """What happens to gradients once per optimizer step, after the last backward of the accumulation window and
    before clipping: tied copies summed over the stages sharing them, then the mean over data-parallel replicas (one
    collective per dtype).

    Running it once per optimizer step (not per accumulated batch) is what ``Strategy.optimizer_step`` allows: the
    closure it receives runs the window's last ``training_step`` and ``backward``; clipping and the step follow.
    """

    def __init__(self, data_parallel_group: Any | None, ties: Sequence[TiedCopy] = ()) -> None:
        self.data_parallel_group = data_parallel_group
        self.ties = list(ties)
        #: synchronisations so far (tests count them)
        self.count = 0

    def synchronize(self, params: Sequence[nn.Parameter]) -> None:
        self.count += 1
        # Each copy holds its stages' share of the tied parameter's gradient; their sum is the whole gradient, and
        # every copy then steps identically (same values, same optimizer state), so the copies stay bitwise equal.
        for tie in self.ties:
            tie.sum_gradients()
        group = self.data_parallel_group
        if group is None or collectives.group_size(group) == 1:
            return
        grads = [p.grad for p in params if p.grad is not None]
        collectives.all_reduce_many_(grads, group, scale=1.0 / collectives.group_size(group))


def clip_grad_norm_across(
    params: Sequence[nn.Parameter], max_norm: float, group: Any | None, not_counted: Sequence[nn.Parameter] = ()
) -> torch.Tensor:
    """Clip by the 2-norm of all gradients of all stages (this rank's part combined over ``group``).

    ``not_counted``: parameters whose gradient another rank counts (copies of a tied parameter), clipped all the same.
    """
    with_grad = [p for p in params if p.grad is not None]
    skip = {id(p) for p in not_counted}
    counted = [p.grad for p in with_grad if id(p) not in skip]
    device = with_grad[0].grad.device if with_grad else torch.device("cpu")
    if counted:
        local = torch.nn.utils.get_total_norm(counted, norm_type=2.0)
    else:
        local = torch.zeros((), device=device)
    squared = local.double().pow(2)
    if group is not None:
        collectives.all_reduce_(squared, group)
    total = squared.sqrt().to(local.dtype)
    if with_grad:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total)
    return total
