"""Private torch names used by lightning-pipe, one function each (checked with torch 2.13).

Replace each with the public API named in its docstring once torch offers it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


# ---------------------------------------------------------------------------------------------------- tensors
def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of (``tensor._base``; ``None`` if it is not a view).

    Public: none; comparing ``untyped_storage().data_ptr()`` tells storage sharing, at several times the cost.
    """
    return tensor._base


# ---------------------------------------------------------------------------------------------------- distributed
def cpu_backend(group: Any) -> Any:
    """The backend object serving CPU tensors in process group ``group`` (``group._get_backend``), whose ``send`` and
    ``recv`` take group ranks; ``None`` where the group has none (or this torch cannot say).

    Public: ``dist.isend``/``dist.irecv``, which reach the same methods after per-call checks and rank lookups.
    """
    get_backend = getattr(group, "_get_backend", None)
    if get_backend is None:
        return None
    try:
        return get_backend(torch.device("cpu"))
    except RuntimeError:
        return None


# ---------------------------------------------------------------------------------------------------- nn.Module
def children(module: nn.Module) -> dict[str, nn.Module | None]:
    """The module's child slots, ``None`` entries included (``module._modules``).

    Public ``named_children()`` skips ``None`` children and cannot be assigned to; stage surgery needs both.
    """
    return module._modules


def set_children(module: nn.Module, slots: Mapping[str, nn.Module | None]) -> None:
    """Replace the module's child slots wholesale, keeping their keys (``module._modules = ...``).

    ``del module_list[i]`` (public) renumbers the entries after ``i``; a stage must keep the full model's keys
    (``layers.5`` stays ``layers.5``), and a shallow-copied stage view must not share the slot dict of the network.
    """
    module.__dict__["_modules"] = dict(slots)


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """Parameters registered directly on ``module`` (``module._parameters``); public ``named_parameters(recurse=False)``
    would do for reading but not for re-registering the same objects under the same names on another module."""
    return module._parameters


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """``[p for p in module.parameters() if p.requires_grad]``, in that order, read from the modules' own registries
    (``_parameters``, ``_modules``): read at every training step, in a quarter of the calls of a walk through
    :func:`own_parameters` and :func:`children` and a tenth of torch's nested generators'."""
    found: list[nn.Parameter] = []
    _walk_trainable(module, found, {}, {})
    return found


def _walk_trainable(module: nn.Module, found: list[nn.Parameter], seen: dict[int, None], visited: dict) -> None:
    # A module-level function, not a closure: a recursive closure is a reference cycle, left to the garbage collector.
    # Dicts, not sets: a dict's item assignment is no call (a set's `add` is one); modules are keys themselves (they
    # hash by identity), parameters by `id` (a tensor's hash is a Python call).
    visited[module] = None
    parameters = module._parameters
    for name in parameters:
        p = parameters[name]
        if p is not None:
            key = id(p)
            if key not in seen:
                seen[key] = None
                if p.requires_grad:
                    found.append(p)
    modules = module._modules
    for name in modules:
        child = modules[name]
        if child is not None and child not in visited:
            _walk_trainable(child, found, seen, visited)


def own_buffers(module: nn.Module) -> dict[str, Any]:
    """Buffers registered directly on ``module`` (``module._buffers``), read like :func:`own_parameters`."""
    return module._buffers


def mark_non_persistent(module: nn.Module, name: str) -> None:
    """Keep buffer ``name`` out of the state dict (``module._non_persistent_buffers_set``).

    Public: ``register_buffer(name, tensor, persistent=False)``, which would re-register the tensor; used when a merged
    module must mirror the original network's state-dict keys exactly.
    """
    module._non_persistent_buffers_set.add(name)


# ---------------------------------------------------------------------------------------------------- checkpoint
def flatten_state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """Flat ``"a.b.c"`` keys of a nested state dict, as torch.distributed.checkpoint stores them
    (``torch.distributed.checkpoint._nested_dict.flatten_state_dict``; no public equivalent in torch 2.13)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    flat, _ = flatten(dict(state))
    return flat


def storage_extents(metadata: Any) -> list[tuple[str, int]]:
    """``(file relative to the checkpoint, end offset)`` of every item a DCP checkpoint stores.

    ``Metadata.storage_data`` maps items to the private ``_StorageInfo(relative_path, offset, length)`` of the
    filesystem writer; torch 2.13 has no public reader of it. Used to detect truncated shards before loading.
    """
    return [(info.relative_path, info.offset + info.length) for info in (metadata.storage_data or {}).values()]


# ---------------------------------------------------------------------------------------------------- memory
def dispatch_mode_class() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``: sees every operator call, which is how CPU tensor bytes are
    counted (torch 2.13 has no CPU allocator statistic; ``torch.cuda.max_memory_allocated`` serves CUDA). Private
    module, but the mode is the documented ``__torch_dispatch__`` extension point."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


# ---------------------------------------------------------------------------------------------------- fake tensors
def fake_tensor_mode() -> Any:
    """A ``torch._subclasses.fake_tensor.FakeTensorMode`` that accepts real tensors as inputs.

    Fake tensors have shapes, dtypes and devices but no data: the dataflow frontend runs the units other stages hold
    on them (what a unit returns, not what it computes), and real tensors that meet one in an operation give a fake
    result. torch 2.13 has no public fake-tensor API (``torch.export`` uses this mode internally).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(value: Any) -> bool:
    """Whether ``value`` is a fake tensor (``torch._subclasses.fake_tensor.FakeTensor``)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def storage_identity(storage: Any) -> int:
    """A storage's identity that asking for its address would give, without asking (a fake tensor's storage warns
    that its address is deprecated): its C++ object's, shared by every view of it."""
    return storage._cdata


def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """What a fake tensor raises when code needs its values or a shape that depends on them (``.item()``, ``if
    t.any()``, ``nonzero``), or meets an operator without a shape function: ``torch._subclasses.fake_tensor``'s
    ``DataDependentOutputException``, ``DynamicOutputShapeException`` and ``UnsupportedOperatorException``."""
    from torch._subclasses import fake_tensor

    return (
        fake_tensor.DataDependentOutputException,
        fake_tensor.DynamicOutputShapeException,
        fake_tensor.UnsupportedOperatorException,
    )


def version(tensor: Any) -> int:
    """The tensor's version counter (``tensor._version``), which every in-place operation increments; torch 2.13
    has no public reader. Tells whether code changed a value in place after it was recorded."""
    return tensor._version


# ---------------------------------------------------------------------------------------------------- operators
# A dispatch mode sees ATen operators; what they read and write is in their schema (`OpOverload._schema`, private;
# torch 2.13 has no public schema accessor).
_UNINITIALISED = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})


def op_name(func: Any) -> str:
    """The operator's name without namespace and overload (``aten::normal_`` -> ``normal_``)."""
    return func._schema.name.split("::")[-1]


def is_operator(func: Any) -> bool:
    """Whether ``func`` is an ATen operator overload (what a dispatch mode sees), not a Python function."""
    from torch._ops import OpOverload

    return isinstance(func, OpOverload)


def reads_values(func: Any) -> bool:
    """Whether the operator reads its tensor inputs' values; ``*_like`` and ``new_*`` factories read only their shape,
    dtype and device."""
    name = op_name(func)
    return not (name.endswith("_like") or name.startswith("new_") or name in _UNINITIALISED)


def fills_nothing(func: Any) -> bool:
    """Whether ``func`` is an operator that allocates without setting values (``empty``, ``new_empty``, ...)."""
    return is_operator(func) and op_name(func) in _UNINITIALISED


def is_copy(func: Any) -> bool:
    """Whether ``func`` is an operator whose output holds its input's values (``clone``, which ``copy.deepcopy`` of
    a Parameter calls; ``copy_``; ``_to_copy``, behind ``.to(dtype)``)."""
    return is_operator(func) and op_name(func) in ("clone", "copy_", "_to_copy")


def is_random(func: Any) -> bool:
    """Whether ``func`` draws from a random generator: an operator tagged ``nondeterministic_seeded`` (``normal_``,
    ``uniform_``, ``randn``, ...), or one of the ``nn.init`` functions recorded whole (all but ``dirac_``)."""
    import torch
    from torch.nn import init

    if is_operator(func):
        return torch.Tag.nondeterministic_seeded in func.tags
    return func is not init.dirac_


#: random operators that draw as many numbers whatever their inputs' values: the output's shape, dtype and strides
#: decide (``poisson``, ``multinomial``, ``_standard_gamma`` draw until values are accepted)
_DRAWS_BY_SHAPE = frozenset(
    {
        *("normal_", "uniform_", "bernoulli_", "random_", "exponential_", "cauchy_", "log_normal_", "geometric_"),
        *("normal", "bernoulli", "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like"),
    }
)


def draws_by_shape(func: Any) -> bool:
    """Whether a random ``func`` draws as many numbers whatever its inputs' values, so that a replay can draw them
    into a scratch tensor of the same layout: the operators above, and the ``nn.init`` functions recorded whole
    (``trunc_normal_``, ``orthogonal_``, ``sparse_`` draw ``uniform_``, ``normal_`` and ``randperm`` by shape)."""
    return not is_operator(func) or op_name(func) in _DRAWS_BY_SHAPE


def returns_view(func: Any) -> bool:
    """Whether the operator returns a view of an input (``view``, ``t``, ``slice``, ...), not new values."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The tensors the operator writes in place: ``self`` of ``normal_``, ``out=`` arguments, ...
    (arguments whose schema alias annotation is a write, ``Tensor(a!)``)."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            written += tensors_of(value)
    return written


def operator_observer(observe: Any) -> Any:
    """A dispatch mode (enter it with ``with``) that runs every operator, then calls ``observe(func, args, kwargs,
    out)``: how the deferred initialisation records and the Hugging Face stage call traces."""

    class _Observer(dispatch_mode_class()):  # type: ignore[misc]
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            observe(func, args, kwargs, out)
            return out

    return _Observer()


def tensors_of(value: Any) -> list[Any]:
    """The tensors in a nested structure of operator arguments or outputs (``torch.utils._pytree``)."""
    import torch
    from torch.utils._pytree import tree_leaves

    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


# ---------------------------------------------------------------------------------------------------- nn.init on meta
def _skipping_inits() -> dict[Any, tuple[Any, Any]]:
    """``code object -> (function to replay, public function)`` of the ``torch.nn.init`` functions that torch 2.13
    returns from at once on a meta tensor (``if tensor.is_meta: return tensor``), so no operator reaches a dispatch
    mode. ``trunc_normal_`` checks in its private helper ``_no_grad_trunc_normal_``."""
    from torch.nn import init

    helper = init._no_grad_trunc_normal_
    return {
        helper.__code__: (helper, init.trunc_normal_),
        init.dirac_.__code__: (init.dirac_, init.dirac_),
        init.orthogonal_.__code__: (init.orthogonal_, init.orthogonal_),
        init.sparse_.__code__: (init.sparse_, init.sparse_),
    }


def is_meta_check(func: Any) -> bool:
    """Whether a torch-function-mode call is the ``Tensor.is_meta`` property read."""
    import torch

    return getattr(func, "__self__", None) is torch.Tensor.is_meta


def skipped_init_call() -> tuple[Any, Any, dict[str, Any]] | None:
    """From inside a torch function mode handling an ``is_meta`` read: when the reader is one of the ``nn.init``
    functions that skip meta tensors, ``(function, tensor, other arguments)`` of its call, read from its frame
    (``sys._getframe``; the function never reaches an operator, so its arguments are nowhere else)."""
    import sys

    functions = _skipping_inits()
    frame = sys._getframe(1)
    for _ in range(4):  # this function, the mode's handler, then the nn.init function reading `is_meta`
        if frame is None:
            return None
        if frame.f_code in functions:
            fn, _public = functions[frame.f_code]
            names = frame.f_code.co_varnames[: frame.f_code.co_argcount]
            arguments = {name: frame.f_locals[name] for name in names}
            return fn, arguments.pop(names[0]), arguments
        frame = frame.f_back
    return None


def in_default_init() -> bool:
    """Whether the running code is inside a ``torch.nn`` module's ``reset_parameters()`` (PyTorch's default init,
    which every ``nn.Linear`` runs in ``__init__``), read from the call stack (``sys._getframe``)."""
    import os
    import sys

    import torch

    modules_dir = os.path.join(os.path.dirname(torch.__file__), "nn", "modules")
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "reset_parameters" and frame.f_code.co_filename.startswith(modules_dir):
            return True
        frame = frame.f_back
    return False


def user_frame(own_file: str) -> str:
    """``file:line (function)`` of the nearest caller outside torch and ``own_file``: where user code made the
    call being recorded (``sys._getframe``, CPython's documented frame access)."""
    import os
    import sys

    import torch

    torch_dir, skipped = os.path.dirname(torch.__file__), (own_file, __file__)
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(torch_dir) or frame.f_code.co_filename in skipped):
        frame = frame.f_back
    if frame is None:
        return "an unknown place"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


# ---------------------------------------------------------------------------------------------------- schedules
def schedule_actions(schedule: str, pipeline_size: int, microbatches: int, stages_per_rank: int) -> list[list[tuple]]:
    """Each pipeline rank's compute actions, in the order torch's schedule runs them: ``(stage, kind, microbatch)``
    with kind ``"F"`` (forward), ``"B"`` (full backward), ``"I"`` (input-gradient backward) or ``"W"`` (weight-gradient
    backward); a DualPipeV ``OVERLAP_F_B`` action becomes its forward then its backward."""
    cells = schedule_cells(schedule, pipeline_size, microbatches, stages_per_rank)
    return [[action for cell in rank for action in cell] for rank in cells]


def schedule_cells(schedule: str, pipeline_size: int, microbatches: int, stages_per_rank: int) -> list[list[list]]:
    """Each pipeline rank's compute cells in torch's order: one ``(stage, kind, microbatch)`` action, or the two of a
    DualPipeV ``OVERLAP_F_B`` (its forward and backward, run back to back).

    ``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops`` builds the schedule on mock stages, so the
    schedule's own checks run: an invalid combination (1F1B with fewer microbatches than stages, DualPipeV with fewer
    than twice the ranks, ZBV with other than 2 stages per rank) raises ``ValueError``. torch 2.13 has no public way
    to read a schedule's action order.
    """
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    try:
        ops = get_schedule_ops(schedule, pipeline_size, microbatches, stages_per_rank)
    except AssertionError as err:  # the visualizer asserts the stages-per-rank rule of single/multi-stage schedules
        raise ValueError(str(err)) from None
    return [[cell for op in rank if op is not None for cell in [_split_action(op)] if cell] for rank in ops]


def _split_action(op: Any) -> list[tuple]:
    kind = str(op.computation_type.value)  # torch's _ComputationType is a str enum: "F", "I", "OVERLAP_F_B", ...
    if op.sub_actions:  # OVERLAP_F_B: (forward; backward) of two stages, run one after the other
        return [action for sub in op.sub_actions for action in _split_action(sub)]
    if kind not in ("F", "B", "I", "W"):
        return []  # communication, resharding, gradient reduction: not compute
    return [(op.stage_index, kind, op.microbatch_index)]


def custom_schedule(stages: list[Any], microbatches: int, loss_fn: Any, rows: list[list[str]]) -> Any:
    """A schedule that runs each pipeline rank's compute actions as given (``rows[rank]``, in torch's spelling:
    ``0F1``, ``1B0``, ``(0F1;3B0)OVERLAP_F_B``).

    torch's ``_PipelineScheduleRuntime`` is the runtime under its own multi-stage schedules: it takes a compute-only
    order (``_Action.from_str``, what its private ``_load_csv`` reads), checks it and adds the sends, receives and
    gradient reductions (``_prepare_schedule_with_comms``). torch 2.13 has no public schedule built from actions.
    """
    from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime

    schedule = _PipelineScheduleRuntime(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule.pipeline_order = {rank: [_Action.from_str(text) for text in row] for rank, row in enumerate(rows)}
    schedule._prepare_schedule_with_comms(schedule.pipeline_order)
    return schedule


# ------------------------------------------------------------------------------------------- pipelining versions
# Public pipelining options that came with torch 2.13; the supported range starts at 2.11 (pyproject.toml).


def stage_takes_mesh() -> bool:
    """Whether ``PipelineStage`` takes ``get_mesh`` (torch 2.13): the mesh on which a received DTensor activation is
    rebuilt. torch 2.11 and 2.12 receive plain tensors only, so a tensor-parallel pipeline needs 2.13."""
    from torch.distributed.pipelining import PipelineStage

    return "get_mesh" in inspect.signature(PipelineStage.__init__).parameters


def step_options(schedule: Any) -> dict[str, bool]:
    """Which of ``schedule.step``'s keyword options this torch has: ``return_outputs`` (do not keep the last stage's
    outputs) and ``loss_kwargs`` (keyword arguments for the loss function), both from torch 2.13. Checked on the
    signature: an older ``step`` passes an unknown keyword on to the stages' forward as a model input."""
    parameters = inspect.signature(type(schedule).step).parameters
    return {name: name in parameters for name in ("return_outputs", "loss_kwargs")}


def connect_neighbours_on_other_ranks_only(stage_class: type) -> None:
    """torch 2.11 and 2.12 connect every stage to its neighbours before the first step
    (``PipelineStage._get_init_p2p_neighbors_ops``), a send and a receive to the stage's own rank where two adjacent
    stages share it (the V placements), which gloo refuses ("Pair is not connected"). Leave those out: a rank needs
    no connection to itself. torch 2.13 has no such step; there this does nothing."""
    base = getattr(stage_class, "_get_init_p2p_neighbors_ops", None)
    if base is None:
        return

    def ops(self: Any) -> list[Any]:
        return [op for op in base(self) if op.group_peer != self.group_rank]

    stage_class._get_init_p2p_neighbors_ops = ops


def keep_tensor_inputs(stage: Any, chunk: int) -> None:
    """torch 2.11 and 2.12 keep every input of a microbatch's stage forward for its backward, keyword arguments
    included (``PipelineStage.fwd_cache``), and their backward reads each as a tensor: the step context and the
    microbatch index that lightning-pipe passes as keywords fail there (torch 2.13 skips what is not a tensor). Keep
    the tensors only; on 2.13 and newer this does nothing."""
    if _BEFORE_2_13:
        output, inputs = stage.fwd_cache[chunk]
        stage.fwd_cache[chunk] = (output, [value for value in inputs if isinstance(value, torch.Tensor)])


_BEFORE_2_13 = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)
#: whether :func:`keep_tensor_inputs` has anything to do on this torch (callers on every microbatch check it first)
KEEPS_EVERY_INPUT = _BEFORE_2_13
