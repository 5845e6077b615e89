"""Gradients across a pipeline: hand-over past Lightning's ``zero_grad``, data-parallel mean, global-norm clipping.

Gradients may be DTensors (FSDP shards, tensor-parallel shards): every operation here works on this rank's part of
them, and the norm counts each element of each gradient once over the whole mesh.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import nn

from lightning_pipe.comm import collectives
from lightning_pipe.comm.dtensor import is_dtensor, local, sharded_axes
from lightning_pipe.compat.torch import trainable_parameters
from lightning_pipe.errors import PipelineModelError
from lightning_pipe.parallel.tensor_parallel import TensorParallelGradients, agreed
from lightning_pipe.settings import DP, PP, TP


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
    def capture(self, params: Sequence[nn.Parameter], released: Sequence[nn.Parameter] = ()) -> Iterator[None]:
        """``released``: parameters whose gradients the caller knows are set to ``None`` after the step before anyone
        reads them (Lightning's ``zero_grad`` as an accumulation window starts). Theirs go now, not after the step,
        so that the process never holds two sets of gradients (one device does not either: its ``zero_grad`` comes
        before its backward). With both sets alive, glibc's allocator handed memory back to the OS and faulted it in
        again: about 3,500 page faults a step per process on the compute-bound benchmark network, where the
        hand-written loop sharing the processes faulted 200-400 (``benchmarks/phases.py --alternate``)."""
        gone = {id(p) for p in released}
        previous = [None if id(p) in gone else p.grad for p in params]
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
            if is_dtensor(g) and tuple(g.placements) != tuple(p.placements):  # type: ignore[attr-defined]
                # DTensor may return a gradient laid out otherwise than its parameter (a vocabulary-parallel
                # embedding's comes back whole): give it the parameter's layout, as the optimizer and the sums expect.
                g = g.redistribute(p.device_mesh, p.placements)  # type: ignore[attr-defined]
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
            collectives.broadcast_(local(self.param.data), self.source, self.group)

    def sum_gradients(self) -> None:
        if not self.param.requires_grad:
            # Frozen (an adapter fine-tune's tied embedding), on every copy alike: no gradient, no optimizer state.
            return
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param)
        # Every copy is laid out alike (FSDP and tensor-parallel shards; `check_layout`): the local parts sum.
        collectives.all_reduce_(local(self.param.grad), self.group)

    def check_layout(self, name: str) -> None:
        """Refuse copies laid out differently on the ranks sharing them (one split over "tp", one whole): their
        local parts would not add up (collective over the copy's group)."""
        p = self.param
        mine = (str(tuple(p.placements)) if is_dtensor(p) else "whole", tuple(local(p).shape))  # type: ignore[attr-defined]
        everyone = collectives.all_gather_object(mine, self.group)
        if len(set(everyone)) > 1:
            ranks = collectives.group_ranks(self.group)
            shown = "; ".join(f"rank {r}: {lay} {shape}" for r, (lay, shape) in zip(ranks, everyone))
            raise PipelineModelError(
                f"The copies of the tied parameter {name!r} on different pipeline stages are laid out differently"
                f" ({shown}), so their gradients cannot be summed. Split every module sharing it alike (e.g. the"
                " embedding with `RowwiseParallel(input_layouts=Replicate())` and the head with `ColwiseParallel`:"
                " both shard the vocabulary), or neither."
            )


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


class ExtraSync(Protocol):
    """More synchronisation a parallelism adds once per optimizer step (tensor parallelism's)."""

    def synchronize(self, params: Sequence[nn.Parameter]) -> None: ...


class GradientSync:
    """What happens to gradients once per optimizer step, after the last backward of the accumulation window and
    before clipping: tied copies summed over the stages sharing them, ``extra`` synchronisation (tensor parallelism's
    partial gradients), then the mean over the replicas of ``data_parallel_group`` when ``average``
    (``data_parallel="ddp"``), in buckets.

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
        extra: ExtraSync | None = None,
    ) -> None:
        self.data_parallel_group = data_parallel_group
        self.average = average
        self.ties = list(ties)
        self.extra = extra
        self.bucket_bytes = bucket_bytes
        self._replicas = collectives.group_size(data_parallel_group)
        #: synchronisations so far, and the buckets of the latest one (tests count them)
        self.count = 0
        self.last_buckets = 0

    def synchronize(self, params: Sequence[nn.Parameter]) -> None:
        self.count += 1
        # Each copy holds its stages' share of the tied parameter's gradient; their sum is the whole gradient, and
        # every copy then steps identically (same values, same optimizer state), so the copies stay bitwise equal.
        for tie in self.ties:
            tie.sum_gradients()
        if self.extra is not None:
            self.extra.synchronize(params)
        group = self.data_parallel_group
        if not self.average or self._replicas == 1:
            self.last_buckets = 0
            return
        grads = [local(p.grad) for p in reversed(params) if p.grad is not None]
        buckets = plan_buckets([(g.numel() * g.element_size(), g.dtype) for g in grads], self.bucket_bytes)
        scale = 1.0 / self._replicas
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


#: ``counted(grad) -> bool``: whether this rank counts ``grad`` in the norm (another rank holding the same part does)
Counted = Callable[[torch.Tensor], bool]


def counted_once(coordinates: Mapping[str, int], over: Sequence[str]) -> Counted:
    """Which gradients a rank counts when the norm is summed over the mesh axes ``over`` (besides "pp"), at
    ``coordinates`` (``{axis: this rank's index}``): a gradient split over an axis is counted by every rank along it
    (each holds another part), one held whole along it only at index 0 (the others hold the same values)."""

    def counted(grad: torch.Tensor) -> bool:
        split = sharded_axes(grad)
        return all(axis in split or coordinates[axis] == 0 for axis in over)

    return counted


def clip_grad_norm_across(
    params: Sequence[nn.Parameter],
    max_norm: float,
    group: Any,
    not_counted: Sequence[nn.Parameter] = (),
    counted: Counted | None = None,
) -> torch.Tensor:
    """Clip by the 2-norm of all gradients of all stages: this rank's part (its shard, for sharded gradients)
    combined over ``group`` (the pipeline; every rank when the stages are sharded over data-parallel or
    tensor-parallel ranks), each part counted by one rank (``counted``, :func:`counted_once`).

    ``not_counted``: parameters whose gradient another rank counts (copies of a tied parameter), clipped all the same.
    """
    skip = {id(p) for p in not_counted}
    local_grads = [
        local(p.grad)
        for p in params
        if p.grad is not None and id(p) not in skip and (counted is None or counted(p.grad))
    ]
    with_grad = [p for p in params if p.grad is not None]
    device = local(with_grad[0].grad).device if with_grad else torch.device("cpu")
    if local_grads:
        mine = torch.nn.utils.get_total_norm(local_grads, norm_type=2.0)
    else:
        mine = torch.zeros((), device=device)
    squared = mine.double().pow(2)
    collectives.all_reduce_(squared, group)
    total = squared.sqrt().to(mine.dtype)
    # As torch.nn.utils.clip_grads_with_norm_, on the local tensors (a DTensor's shard is a view of it).
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in with_grad:
        grad = local(p.grad)
        grad.mul_(coefficient.to(grad.device))
    return total


class TieGroups:
    """This rank's copies of parameters that units of several stages share (:class:`TiedCopy`), each with the process
    group of the ranks holding a copy: one group per tie, data-parallel replica and tensor-parallel rank (a copy's
    parts are summed with the same parts of the other stages' copies).

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
        if self._mesh is not mesh:
            self._mesh, self._groups = mesh, _tie_groups(layout, ties, stage_ranks)
        copies, names = [], []
        for tie in ties:
            if tie.names not in self._groups:
                continue
            param = next(parameters[prefix + n] for n in tie.names if prefix + n in parameters)
            group, source = self._groups[tie.names]
            copies.append(TiedCopy(param, group, source))
            names.append(prefix + tie.canonical)
        if layout.tensor_parallel_size > 1:
            _check_layouts(copies, names)  # before `agree`: a broadcast between shards of different shapes would hang
        for copy in copies:
            copy.agree()  # copies initialised per module (meta construction) start from the first stage's values
        return copies


def _tie_groups(layout: Any, ties: Sequence[Any], stage_ranks: Sequence[int]) -> dict[tuple[str, ...], tuple[Any, int]]:
    """This rank's group and source rank per tie (collective: every rank creates every group, in one order)."""
    me = collectives.world_rank()
    groups = {}
    for tie in ties:
        owners = sorted({stage_ranks[s] for s in tie.stages})
        if len(owners) < 2:
            continue  # every stage sharing it lives on one rank: one Parameter object, nothing to sum
        for replica in range(layout.data_parallel_size):
            for tp in range(layout.tensor_parallel_size):
                ranks = [layout.rank(replica, p, tp) for p in owners]
                group = collectives.new_group(ranks)
                if me in ranks:
                    groups[tie.names] = (group, layout.rank(replica, stage_ranks[tie.stages[0]], tp))
    return groups


def _check_layouts(copies: Sequence[TiedCopy], names: Sequence[str]) -> None:
    """Every copy's layout checked in its group, then the first problem raised on every rank of the world."""
    problems = []
    for copy, name in zip(copies, names):
        try:
            copy.check_layout(name)  # collective in the copy's group: every copy is checked
        except PipelineModelError as err:
            problems.append(str(err))
    with agreed(collectives.world_group()):
        if problems:
            raise PipelineModelError(problems[0])


class StageGradients:
    """This rank's gradients through one Trainer entry: the schedule's gradients held past Lightning's ``zero_grad``
    (:class:`GradientStash`), synchronised once per optimizer step (:class:`GradientSync`), and clipped by the norm
    over every stage (:func:`clip_grad_norm_across`).

    ``module``: the LightningModule; ``sharded``: its stages are FSDP roots, whose sharded parameters (fixed after
    wrapping) receive the reduce-scattered gradients; otherwise the trainable parameters as they are at each step.
    The norm is summed over ``norm_group`` (the pipeline, or the whole world when parameters are sharded over
    data-parallel or tensor-parallel ranks), each part counted by one rank (``counted``); ``extra``: tensor
    parallelism's synchronisation.
    """

    def __init__(
        self,
        module: nn.Module,
        ties: Sequence[TiedCopy],
        data_parallel_group: Any,
        norm_group: Any,
        sharded: bool,
        counted: Counted | None = None,
        extra: ExtraSync | None = None,
    ) -> None:
        self.module = module
        self.stash = GradientStash()
        self.sync = GradientSync(data_parallel_group, average=not sharded, ties=ties, extra=extra)
        self.norm_group = norm_group
        self.counted = counted
        self._sharded = trainable_parameters(module) if sharded else None
        me = collectives.world_rank()
        #: copies of tied parameters whose gradient another rank counts in the norm
        self._copies = [t.param for t in ties if t.source != me]

    def parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients a training step hands over to ``backward``. With FSDP: the sharded ones
        (inside an accumulation window the registered parameters are FSDP's unsharded ones, whose gradients keep
        accumulating untouched until the window's last batch)."""
        return self._sharded if self._sharded is not None else trainable_parameters(self.module)

    def capture(self, released: Sequence[nn.Parameter] = ()) -> Any:
        """Around a schedule step: its gradients are held, not added to ``.grad`` yet (``released``: see
        :meth:`GradientStash.capture`)."""
        return self.stash.capture(self.parameters(), released)

    def synchronize(self, optimizer: Any) -> None:
        """The gradients of ``optimizer``'s parameters averaged over data-parallel replicas, summed over tied
        copies (:class:`GradientSync`)."""
        self.sync.synchronize([p for group in optimizer.param_groups for p in group["params"]])

    def clip(self, optimizer: Any, max_norm: float) -> torch.Tensor:
        """Lightning's ``clip_grad_by_norm`` with the norm of every stage's gradients; returns that norm (before
        clipping)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return clip_grad_norm_across(params, max_norm, self.norm_group, not_counted=self._copies, counted=self.counted)


def stage_gradients(module: nn.Module, ties: Sequence[TiedCopy], mesh: Any, wrapped: Any) -> StageGradients:
    """This rank's :class:`StageGradients` on the strategy's ``mesh`` (axes ``"pp"``, ``"dp"``, ``"tp"``), for stages
    wrapped as ``wrapped`` says (:class:`~lightning_pipe.parallel.wrappers.Wrapped`).

    The norm spans the pipeline, or the whole world when parameters are split over data-parallel (FSDP) or
    tensor-parallel ranks, each element counted once (:func:`counted_once`). With tensor parallelism, parameters
    whole on every rank but applied to split activations (``wrapped.tensor_parallel.partial``) get their gradients
    summed over ``"tp"``.
    """
    sharded = wrapped.sharded
    partial = wrapped.tensor_parallel.partial if wrapped.tensor_parallel is not None else ()
    tp_group = mesh.get_group(TP)
    tensor_parallel = collectives.group_size(tp_group) > 1
    over = (DP, TP) if sharded or tensor_parallel else ()
    coordinates = {DP: mesh.get_local_rank(DP), TP: mesh.get_local_rank(TP)}
    return StageGradients(
        module,
        ties,
        mesh.get_group(DP),
        collectives.world_group() if over else mesh.get_group(PP),
        sharded,
        counted=counted_once(coordinates, over),
        extra=TensorParallelGradients(module, tp_group, partial) if tensor_parallel else None,
    )


#: the stand-in parameter's name on the network while a rank without parameters builds its optimizers
STAND_IN = "lightning_pipe_no_parameters"


def build_optimizers(
    network: nn.Module, module: nn.Module, setup: Callable[[], None], optimizers: Callable[[], Sequence[Any]]
) -> None:
    """``setup()`` (Lightning's, which runs ``configure_optimizers``), also on a rank whose stages hold no parameter
    (the pass-on stages of a one-unit network: Lightning's ``BoringModel`` on two devices).

    torch's optimizers refuse an empty parameter list, and Lightning's loop and the learning-rate schedulers need
    them: while ``setup`` runs, the network holds one zero-element stand-in parameter, then taken out of the network
    and out of the ``optimizers()``' param groups, which stay empty. A step then changes nothing (this rank has
    nothing to change), the schedulers step the groups' hyperparameters, and checkpoints treat the groups as any
    param group without parameters on a rank.
    """
    if any(True for _ in module.parameters()):
        setup()
        return
    stand_in = nn.Parameter(torch.empty(0))
    network.register_parameter(STAND_IN, stand_in)
    try:
        setup()
    finally:
        delattr(network, STAND_IN)
    for optimizer in optimizers():
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if p is not stand_in]
