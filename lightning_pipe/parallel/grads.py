"""Gradients across a pipeline: hand-over past Lightning's ``zero_grad``, data-parallel mean, global-norm clipping."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_pipe.comm import collectives


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
            collectives.broadcast_(_local(self.param.data), self.source, self.group)

    def sum_gradients(self) -> None:
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param)
        # Under FSDP every copy is sharded alike over its replica group: the local shards sum.
        collectives.all_reduce_(_local(self.param.grad), self.group)


#: Bucket size of the data-parallel all-reduce, as ``DistributedDataParallel``'s default ``bucket_cap_mb=25``.
DEFAULT_BUCKET_BYTES = 25 * 2**20


def plan_buckets(sizes: Sequence[tuple[int, torch.dtype]], bucket_bytes: int) -> list[list[int]]:
    """Group tensors (``(bytes, dtype)`` each, in the order given) into buckets: consecutive tensors of one dtype
    holding at most ``bucket_bytes`` together; a tensor larger than that is a bucket of its own. Returns indices."""
    buckets: list[list[int]] = []
    open_by_dtype: dict[torch.dtype, tuple[list[int], int]] = {}
    for i, (nbytes, dtype) in enumerate(sizes):
        bucket, filled = open_by_dtype.get(dtype, ([], 0))
        if bucket and filled + nbytes > bucket_bytes:
            bucket, filled = [], 0
        if not bucket:
            buckets.append(bucket)
        bucket.append(i)
        open_by_dtype[dtype] = (bucket, filled + nbytes)
    return buckets


class GradientSync:
    """What happens to gradients once per optimizer step, after the last backward of the accumulation window and
    before clipping: tied copies summed over the stages sharing them, then the mean over the replicas of
    ``data_parallel_group`` when ``average`` (``data_parallel="ddp"``), in buckets.

    Running it once per optimizer step (not per accumulated batch) is what ``Strategy.optimizer_step`` allows: the
    closure it receives runs the window's last ``training_step`` and ``backward``; clipping and the step follow.
    Buckets hold at most ``bucket_bytes`` of one dtype, in reverse parameter order (the order backward produces
    them); all are started before the first is waited for, so one bucket's copy overlaps the others' reduction.
    Without ``average`` (FSDP, whose reduce-scatter runs inside the schedule) or with one replica: nothing to average.
    """

    def __init__(
        self,
        data_parallel_group: Any,
        average: bool,
        ties: Sequence[TiedCopy] = (),
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.data_parallel_group = data_parallel_group
        self.average = average
        self.ties = list(ties)
        self.bucket_bytes = bucket_bytes
        #: synchronisations so far, and the buckets of the latest one (tests count them)
        self.count = 0
        self.last_buckets = 0

    def synchronize(self, params: Sequence[nn.Parameter]) -> None:
        self.count += 1
        # Each copy holds its stages' share of the tied parameter's gradient; their sum is the whole gradient, and
        # every copy then steps identically (same values, same optimizer state), so the copies stay bitwise equal.
        for tie in self.ties:
            tie.sum_gradients()
        group = self.data_parallel_group
        if not self.average or collectives.group_size(group) == 1:
            self.last_buckets = 0
            return
        grads = [p.grad for p in reversed(params) if p.grad is not None]
        buckets = plan_buckets([(g.numel() * g.element_size(), g.dtype) for g in grads], self.bucket_bytes)
        scale = 1.0 / collectives.group_size(group)
        started = [
            collectives.all_reduce_start(torch.cat([grads[i].reshape(-1) for i in bucket]), group) for bucket in buckets
        ]
        for bucket, handle in zip(buckets, started):
            flat = collectives.all_reduce_finish(handle).mul_(scale)
            offset = 0
            for i in bucket:
                grads[i].copy_(flat[offset : offset + grads[i].numel()].view_as(grads[i]))
                offset += grads[i].numel()
        self.last_buckets = len(buckets)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (FSDP), ``t`` itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def clip_grad_norm_across(
    params: Sequence[nn.Parameter], max_norm: float, group: Any, not_counted: Sequence[nn.Parameter] = ()
) -> torch.Tensor:
    """Clip by the 2-norm of all gradients of all stages: this rank's part (its shard, for sharded gradients)
    combined over ``group`` (the pipeline; every rank when the stages are sharded over data-parallel ranks).

    ``not_counted``: parameters whose gradient another rank counts (copies of a tied parameter), clipped all the same.
    """
    skip = {id(p) for p in not_counted}
    local_grads = [_local(p.grad) for p in params if p.grad is not None and id(p) not in skip]
    with_grad = [p for p in params if p.grad is not None]
    device = _local(with_grad[0].grad).device if with_grad else torch.device("cpu")
    if local_grads:
        local = torch.nn.utils.get_total_norm(local_grads, norm_type=2.0)
    else:
        local = torch.zeros((), device=device)
    squared = local.double().pow(2)
    collectives.all_reduce_(squared, group)
    total = squared.sqrt().to(local.dtype)
    # As torch.nn.utils.clip_grads_with_norm_, on the local tensors (a DTensor's shard is a view of it).
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in with_grad:
        grad = _local(p.grad)
        grad.mul_(coefficient.to(grad.device))
    return total


class TieGroups:
    """This rank's copies of parameters that units of several stages share (:class:`TiedCopy`), each with the process
    group of the ranks holding a copy: one group per tie and data-parallel replica.

    Groups are made once per mesh (every rank creates every group, in one order: a collective) and reused by later
    Trainer entries.
    """

    def __init__(self) -> None:
        self._mesh: Any = None
        self._groups: dict[tuple[str, ...], tuple[Any, int]] = {}

    def copies(self, mesh: Any, layout: Any, split: Any, module: nn.Module) -> list[TiedCopy]:
        """This rank's copies of the :class:`~lightning_pipe.split.builder.Split`'s ties in ``module`` (the
        LightningModule, wrapped), each given the value of the stage that holds it under its first name. ``layout`` is
        the :class:`~lightning_pipe.comm.mesh.MeshLayout` of ``mesh``. Collective."""
        ties, stage_ranks, prefix = split.ties, split.stage_ranks, split.prefix
        parameters = dict(module.named_parameters(remove_duplicate=False))
        me = collectives.world_rank()
        if self._mesh is not mesh:
            groups = {}
            for tie in ties:
                owners = sorted({stage_ranks[s] for s in tie.stages})
                if len(owners) < 2:
                    continue  # every stage sharing it lives on one rank: one Parameter object, nothing to sum
                for replica in range(layout.data_parallel_size):
                    ranks = [layout.rank(replica, p) for p in owners]
                    group = collectives.new_group(ranks)
                    if me in ranks:
                        groups[tie.names] = (group, layout.rank(replica, stage_ranks[tie.stages[0]]))
            self._mesh, self._groups = mesh, groups
        copies = []
        for tie in ties:
            if tie.names not in self._groups:
                continue
            param = next(parameters[prefix + n] for n in tie.names if prefix + n in parameters)
            group, source = self._groups[tie.names]
            copies.append(TiedCopy(param, group, source))
        for copy in copies:
            copy.agree()  # copies initialised per module (meta construction) start from the first stage's values
        return copies


class StageGradients:
    """This rank's gradients through one Trainer entry: the schedule's gradients held past Lightning's ``zero_grad``
    (:class:`GradientStash`), synchronised once per optimizer step (:class:`GradientSync`), and clipped by the norm
    over every stage (:func:`clip_grad_norm_across`).

    ``module``: the LightningModule; ``sharded``: its stages are FSDP roots, whose sharded parameters (fixed after
    wrapping) receive the reduce-scattered gradients, and whose gradient norm spans the whole world
    (``norm_group``); otherwise the trainable parameters as they are at each step, and the pipeline's group.
    """

    def __init__(
        self,
        module: nn.Module,
        ties: Sequence[TiedCopy],
        data_parallel_group: Any,
        norm_group: Any,
        sharded: bool,
    ) -> None:
        self.module = module
        self.stash = GradientStash()
        self.sync = GradientSync(data_parallel_group, average=not sharded, ties=ties)
        self.norm_group = norm_group
        self._sharded = _trainable(module) if sharded else None
        me = collectives.world_rank()
        #: copies of tied parameters whose gradient another rank counts in the norm
        self._copies = [t.param for t in ties if t.source != me]

    def parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients a training step hands over to ``backward``. With FSDP: the sharded ones
        (inside an accumulation window the registered parameters are FSDP's unsharded ones, whose gradients keep
        accumulating untouched until the window's last batch)."""
        return self._sharded if self._sharded is not None else _trainable(self.module)

    def capture(self) -> Any:
        """Around a schedule step: its gradients are held, not added to ``.grad`` yet."""
        return self.stash.capture(self.parameters())

    def clip(self, optimizer: Any, max_norm: float) -> None:
        """Lightning's ``clip_grad_by_norm`` with the norm of every stage's gradients."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_across(params, max_norm, self.norm_group, not_counted=self._copies)


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]
