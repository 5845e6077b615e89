"""Tensor parallelism inside every stage: the processes of the mesh's ``"tp"`` axis share each stage, every layer split
across them with DTensor (``torch.distributed.tensor.parallel``).

Whose plan: the user's, applied in ``configure_model`` with ``parallelize_module`` and ``self.device_mesh["tp"]`` to
the units this rank holds (the strategy cuts the network first, as torchtitan does), or, for a Hugging Face model
without one, the model kind's own (a transformers model's ``config.base_model_tp_plan``, read by
:mod:`lightning_pipe.models.huggingface.tensor_parallel`), applied here.
Either way this module then makes the result exact:

- ``parallelize_module`` replaces a module's parameters, which unties a parameter that two units share (an input
  embedding and its output head): :func:`retie` makes them one again, refusing layouts that differ;
- every tensor-parallel parameter must live on the strategy's mesh (:func:`check_meshes`);
- a parameter kept whole on every tensor-parallel rank must get the same gradient on each
  (:class:`TensorParallelGradients` checks it on the first step); one applied to split activations gets a partial
  gradient, summed over the ranks when the plan says so (transformers' ``replicated_with_grad_allreduce``).

The order of per-stage wrappers is tensor parallelism, activation checkpointing, FSDP (see
:func:`lightning_pipe.parallel.wrappers.wrap_stages`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_pipe.comm import collectives
from lightning_pipe.comm.dtensor import axis_names, is_dtensor, local, sharded_axes
from lightning_pipe.errors import PipelineConfigError, PipelineModelError
from lightning_pipe.models import kind_of
from lightning_pipe.models.huggingface.tensor_parallel import describe
from lightning_pipe.settings import TP
from lightning_pipe.split.builder import Split

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Gradients of a whole parameter may differ between tensor-parallel ranks by float noise only (they are computed from
#: the same values by the same operations, so in practice they are equal).
WHOLE_GRADIENT_RTOL = 1e-5


def style(name: str) -> Any:
    """torch's ``ParallelStyle`` for a style name of :mod:`lightning_pipe.models.huggingface.tensor_parallel`."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "vocab_parallel_embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    return styles[name]()


def tensor_parallel_parameters(module: nn.Module) -> list[str]:
    """Names of ``module``'s parameters split over the ``"tp"`` axis (DTensors on a mesh with that axis)."""
    return [name for name, p in module.named_parameters() if TP in axis_names(p)]


@dataclass
class TensorParallelDone:
    """What :meth:`TensorParallel.apply` did on this rank."""

    #: modules parallelised from a Hugging Face model's own plan, with their style (empty: the user's plan)
    planned: dict[str, str] = field(default_factory=dict)
    #: parameters kept whole on every tensor-parallel rank whose gradient is summed over the ranks
    partial: list[nn.Parameter] = field(default_factory=list)


class TensorParallel:
    """The first per-stage wrapper: tensor parallelism for ``split``'s network (cut to this rank's stages) on the
    strategy's ``mesh`` (its ``"tp"`` axis splits the layers).

    From the split it takes the names of every parameter the network reached under several names before the cut (a
    tie inside one stage too: ``split.shared``) and what an earlier Trainer entry did (``split.tensor_parallel``: a
    model's own plan is applied once).
    """

    def __init__(self, split: Split, mesh: DeviceMesh) -> None:
        self.network = split.network
        self.shared = list(split.shared)
        self.mesh = mesh
        self.previous: TensorParallelDone | None = split.tensor_parallel

    def apply(self) -> TensorParallelDone:
        """Apply the Hugging Face model's own plan when no rank has tensor-parallel parameters (the user applied no
        plan), then re-tie and check. Collective over the world (every rank must know whether any applied a plan)."""
        done = self.previous or TensorParallelDone()
        mine = torch.tensor([1 if tensor_parallel_parameters(self.network) else 0])
        if not int(collectives.all_reduce_(mine, collectives.world_group()).item()):
            chosen = kind_of(self.network).tensor_parallel_plan(self.network, self.mesh[TP].size(), self.shared)
            if chosen is None:
                size = self.mesh[TP].size()
                raise PipelineConfigError(
                    f"`tensor_parallel={size}` but no parameter of {type(self.network).__name__} is split over the"
                    " 'tp' axis: the processes of each stage would all compute the same thing. Apply a plan in"
                    " `configure_model` (`parallelize_module(block, self.device_mesh['tp'], plan)` for each block this"
                    " rank holds; build the network in `__init__` so that the strategy cuts it first), or set"
                    " `tensor_parallel=1`."
                )
            done = self._apply_model_plan(chosen)
        with agreed(collectives.world_group()):
            retie(self.network, self.shared)
            check_meshes(self.network, self.mesh)
        return done

    def _apply_model_plan(self, chosen: dict[str, str]) -> TensorParallelDone:
        from torch.distributed.tensor.parallel import parallelize_module

        tp_mesh = self.mesh[TP]
        done = TensorParallelDone(planned=chosen)
        for name, style_name in chosen.items():
            module = self.network.get_submodule(name)
            if style_name == "replicated_with_grad_allreduce":
                done.partial += [p for p in module.parameters() if p.requires_grad]
            else:
                parallelize_module(module, tp_mesh, style(style_name))
        return done


def describe_plan(done: TensorParallelDone) -> str:
    return describe(done.planned)


@contextmanager
def agreed(group: Any) -> Iterator[None]:
    """A ``PipelineModelError`` raised inside on some ranks of ``group`` is raised on all of them, so that none waits in
    a later collective for ranks that stopped (collective over ``group``: every rank runs the block)."""
    problem = None
    try:
        yield
    except PipelineModelError as err:
        problem = str(err)
    found = [p for p in collectives.all_gather_object(problem, group) if p is not None]
    if found:
        raise PipelineModelError(problem or found[0])


def _owner(network: nn.Module, name: str) -> tuple[nn.Module, str] | None:
    parent, _, leaf = name.rpartition(".")
    try:
        owner = network.get_submodule(parent) if parent else network
    except AttributeError:
        return None  # a unit another stage holds
    return (owner, leaf) if isinstance(getattr(owner, leaf, None), nn.Parameter) else None


def _layout(p: torch.Tensor) -> str:
    if not is_dtensor(p):
        return f"whole {tuple(p.shape)}"
    return f"{tuple(p.placements)} over {axis_names(p)} {tuple(p.shape)}"  # type: ignore[attr-defined]


def retie(network: nn.Module, shared: Sequence[tuple[str, ...]]) -> None:
    """Make the names of each group in ``shared`` that this rank holds one parameter again.

    ``parallelize_module`` registers new parameters on the modules it splits, so a head tied to its input embedding
    gets its own; the two would then train apart. They were one tensor before, so they hold the same values: the
    first name's parameter is kept. Both must be laid out alike (e.g. the vocabulary split over "tp" on both).
    """
    for names in shared:
        held = [(name, found) for name in names if (found := _owner(network, name)) is not None]
        params = [getattr(owner, leaf) for _, (owner, leaf) in held]
        if len({id(p) for p in params}) < 2:
            continue
        first = params[0]
        for (name, (owner, leaf)), p in zip(held[1:], params[1:]):
            if p is first:
                continue
            if _layout(p) != _layout(first) or (is_dtensor(p) and p.device_mesh != first.device_mesh):  # type: ignore[attr-defined]
                raise PipelineModelError(
                    f"{held[0][0]!r} and {name!r} are one parameter (tied), but tensor parallelism laid them out"
                    f" differently: {_layout(first)} and {_layout(p)}. Split both alike, e.g. the embedding with"
                    " `RowwiseParallel(input_layouts=Replicate())` and the head with `ColwiseParallel(...)` (both shard"
                    " the vocabulary), or neither."
                )
            setattr(owner, leaf, first)


def check_meshes(module: nn.Module, mesh: DeviceMesh) -> None:
    """Refuse a parameter split over a device mesh other than (a part of) the strategy's ``mesh``."""
    axes = tuple(mesh.mesh_dim_names or ())
    for name, p in module.named_parameters():
        if not is_dtensor(p):
            continue
        own = axis_names(p)
        ranks = p.device_mesh.mesh.flatten().tolist()  # type: ignore[attr-defined]
        expected = None
        if own and set(own) <= set(axes):
            expected = mesh[own[0] if len(own) == 1 else own].mesh.flatten().tolist()
        if ranks != expected:
            raise PipelineModelError(
                f"Parameter {name!r} is split over a device mesh with axes {own} and ranks {ranks}, not over the"
                f" strategy's {axes} mesh (its 'tp' axis: ranks {mesh[TP].mesh.flatten().tolist()} share this rank's"
                " stages). Apply tensor-parallel plans with `self.device_mesh['tp']` in `configure_model`. A module"
                " split by an earlier Trainer with another `tensor_parallel` needs a new LightningModule instance"
                " (load a checkpoint into it)."
            )


def _differ(a: tuple[int, float, float] | None, b: tuple[int, float, float]) -> bool:
    """Whether two ``(numel, sum, sum of squares)`` summaries of one gradient differ beyond float noise."""
    if a is None:
        return False
    squares = max(a[2], b[2])
    # |sum| <= sqrt(numel * sum of squares): both compared on the scale of the gradient's size.
    return abs(a[2] - b[2]) > WHOLE_GRADIENT_RTOL * squares or abs(a[1] - b[1]) > WHOLE_GRADIENT_RTOL * (
        (a[0] * squares) ** 0.5
    )


def check_whole_gradients(named: Sequence[tuple[str, nn.Parameter]], group: Any) -> None:
    """Refuse parameters held whole by every tensor-parallel rank whose gradients differ between the ranks.

    A whole parameter applied to split activations (a per-head norm after a "colwise" projection) gets only its own
    heads' share of the gradient on each rank; without a sum over the ranks the copies drift apart silently. Collective
    over ``group`` (the ``"tp"`` axis); meant for the first step.
    """
    stats = {}
    for name, p in named:
        if p.grad is not None and TP not in sharded_axes(p.grad):
            g = local(p.grad).double()
            stats[name] = (g.numel(), float(g.sum()), float(g.pow(2).sum()))
    everyone = collectives.all_gather_object(stats, group)
    differ = [name for other in everyone[1:] for name in other if _differ(everyone[0].get(name), other[name])]
    with agreed(collectives.world_group()):
        _refuse_differing(differ)


def _refuse_differing(differ: Sequence[str]) -> None:
    if differ:
        shown = ", ".join(repr(n) for n in sorted(set(differ))[:5])
        raise PipelineModelError(
            f"Parameters {shown} are held whole by every tensor-parallel process of a stage but got different"
            " gradients on them: they are applied to activations that tensor parallelism split (e.g. a per-head norm"
            " after a 'colwise' projection), so each process computed only its share and the copies would drift"
            " apart. Give them a tensor-parallel style (for a Hugging Face model: transformers >= 5, whose plans mark"
            " them 'replicated_with_grad_allreduce'), or leave the activations they see whole."
        )


class TensorParallelGradients:
    """What tensor parallelism adds to the once-per-optimizer-step gradient synchronisation: the gradients of
    ``partial`` parameters summed over ``group`` (the ``"tp"`` axis), and on the first step
    :func:`check_whole_gradients` over ``module``'s parameters."""

    def __init__(self, module: nn.Module, group: Any, partial: Sequence[nn.Parameter] = ()) -> None:
        self.module = module
        self.group = group
        self.partial = list(partial)
        self.checked = False

    def synchronize(self, params: Sequence[nn.Parameter]) -> None:
        for p in self.partial:
            if p.grad is not None:
                collectives.all_reduce_(local(p.grad), self.group)
        if not self.checked:
            self.checked = True
            with_grad = {id(p) for p in params if p.grad is not None}
            named = [(n, p) for n, p in self.module.named_parameters() if id(p) in with_grad]
            check_whole_gradients(named, self.group)


def loss_parallel_context(enabled: bool) -> AbstractContextManager[None]:
    """``torch.distributed.tensor.parallel.loss_parallel()`` around a whole step when ``enabled``: the user's step
    computes the loss and the schedule back-propagates it inside it, so a head whose output stays split over the
    vocabulary (a DTensor) works with an unchanged ``F.cross_entropy``. The step must not enter ``loss_parallel()``
    itself: leaving the inner one switches loss parallelism off before the schedule's backward. (Not enabled: a
    context that does nothing, shared, entered at every step.)"""
    if not enabled:
        return _NOTHING
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


_NOTHING: AbstractContextManager[None] = nullcontext()
