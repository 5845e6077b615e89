"""How one stage of a transformers model runs: the model's own forward, entered at the stage's first block and left
at the next stage's first block.

Every stage calls the whole task model with the microbatch's own call (``use_cache=False``), on a module whose units
of other stages are stand-ins (:func:`lightning_pipe.models.huggingface.plan.hf_placeholder`):

- **entry** (stages after the first): the embedding's stand-in returns zeros shaped like the received hidden states,
  so the forward builds its masks and position embeddings as on the first stage; the blocks before the stage's
  first block (stand-ins) return the received hidden states, so that block gets exactly what the previous stage
  sent. What the forward does between the embedding and the blocks (Gemma's sqrt(hidden_size) scale, Granite's
  embedding multiplier) only ever touches the discarded zeros: it is applied once, on the first stage.
- **exit** (stages before the last): the stand-in of the next stage's first block stops the forward and the stage
  sends that block's input, i.e. what the next block receives on one device. The final norm and the head are never
  reached (OLMo's norm has no parameters, so it is on every stage, and would otherwise run twice).
- the last stage's call returns what the model returns on one device (logits, ``loss`` when ``labels`` are given).
- mixture-of-experts models called with ``output_router_logits=True``: every stage's router logits travel with the
  hidden states to the last stage, whose load-balancing loss sees every layer's (:mod:`.router_logits`).
- per-layer inputs (Gemma 4, Gemma 3n): the first stage computes them and each stage sends, right after the hidden
  states, the slices of the layers after its own (:mod:`.per_layer`).
- AltUp (Gemma 3n): the hidden states between blocks are a stack of streams, sent whole (:mod:`.altup`).

transformers 4.x blocks of some families return tuples that the forward unpacks (``layer_outputs[0]``); the stand-ins
return the hidden states the way the stage's blocks do, found on the stage's first call (:data:`_STYLE`).

Once per stage, the first call also checks that no value computed from the embedding's output reaches the stage's
blocks by another way than the hidden states (a family that adds the embeddings to every block's input would get
zeros on a later stage): values derived from the stand-in's zeros are tracked through every operator.
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_pipe.compat import torch as torch_compat
from lightning_pipe.compat.transformers import cache_argument
from lightning_pipe.errors import PipelineModelError, PipelineUsageError
from lightning_pipe.models.huggingface import altup, router_logits, vision
from lightning_pipe.models.huggingface.generation import StageCaches
from lightning_pipe.models.huggingface.per_layer import PerLayerInputs, check_shared_kv, has_per_layer_inputs
from lightning_pipe.models.huggingface.plan import AbsentInput, PassThrough, base_prefix, block_stack

#: On a stage view, how its blocks return their output: "tensor" or "tuple" (transformers 4.x families whose forward
#: unpacks ``layer_outputs[0]``). A stage view is lightning-pipe's own shallow copy of the network.
_STYLE = "_lightning_pipe_block_output"
#: On a stage view: its forward was checked once for embedding values reaching its blocks.
_CHECKED = "_lightning_pipe_entry_checked"
_STYLES = ("tensor", "tuple")


class _StageExit(BaseException):
    """Stops the forward at the next stage's first block. A ``BaseException``, like ``GeneratorExit``: it is control
    flow, and no ``except Exception`` in model code between the hook and the stage call must swallow it."""

    def __init__(self, hidden: Any) -> None:
        super().__init__()
        self.hidden = hidden


class _WrongStyle(BaseException):
    """The stage's first block did not receive the hidden states returned in this style: try the other."""


def hf_stage_call(
    view: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    received: tuple[Tensor, ...] | Tensor | None,
    is_first: bool,
    is_last: bool,
) -> Any:
    """Run one stage of a transformers model on one microbatch of the network call ``view(*args, **kwargs)``.

    Stages before the last return the hidden states tensor that the next stage's first block takes; the last returns
    what the call returns on one device (``CausalLMOutputWithPast`` with ``loss`` when ``labels`` are given).
    """
    return run_stage(view, view, args, kwargs, received, is_first, is_last)


def run_stage(
    view: nn.Module,
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    received: tuple[Tensor, ...] | Tensor | None,
    is_first: bool,
    is_last: bool,
) -> Any:
    """:func:`hf_stage_call` of a stage view whose transformers model is ``model``: ``view`` itself, or the model a
    wrapper holds (a PEFT model's ``base_model.model``), whose blocks the stage enters and leaves while ``view`` is
    called."""
    call = prepare_call(view, args, kwargs, model)
    if not is_first:
        call = vision.later_stage_call(call)
    blocks = _blocks(model)
    local = [i for i, block in enumerate(blocks) if not isinstance(block, PassThrough)]
    if not local and not is_first:
        raise PipelineModelError(
            f"A stage of {type(view).__name__} after the first holds none of its blocks (only what follows them), so"
            " it has no block at which to take the hidden states it receives. Give the last stage at least one block"
            " (fewer stages, or `balance=` that puts a block on it)."
        )
    # A first stage may hold only what precedes the blocks (a vision-language model's embedding and vision tower).
    exit_index = local[-1] + 1 if local else 0
    if not is_last and exit_index == len(blocks):
        raise PipelineModelError(
            f"The stage of {type(view).__name__} after this one holds none of its blocks (only what follows them),"
            " so it has no block at which to take the hidden states this stage sends. Give every stage after the"
            " first at least one block (`balance='blocks'`, or fewer stages)."
        )
    exit_block = None if is_last else blocks[exit_index]
    base = _per_layer_base(model, local, is_first and is_last)
    if is_first:
        carry = router_logits.Carry(model, call, (), is_last)
        inputs = PerLayerInputs(base, 0, None)
        with carry.recording(), inputs.installed():
            out = carry.output(_run(view, call, exit_block, None))
        return _send_per_layer(out, inputs, exit_index, is_last)
    hidden, carried = _received(received)
    per_layer, carried = (carried[0], carried[1:]) if base is not None and carried else (None, carried)
    inputs = PerLayerInputs(base, local[0], per_layer)
    carry = router_logits.Carry(model, call, carried, is_last)
    known = view.__dict__.get(_STYLE)
    for style in (known,) if known else _STYLES:
        entry = _Entry(view, blocks, local[0], hidden, style, altup.embedding_like(_base(model), hidden))
        try:
            with carry.recording(), inputs.installed():
                if _CHECKED in view.__dict__:
                    out = _run(view, call, exit_block, entry)
                else:
                    with _EmbeddingValues(view, [blocks[i] for i in local]):
                        out = _run(view, call, exit_block, entry)
                    view.__dict__[_CHECKED] = True
        except _WrongStyle:
            continue
        view.__dict__[_STYLE] = style
        return _send_per_layer(carry.output(out), inputs, exit_index, is_last)
    raise PipelineModelError(
        f"The forward of {type(view).__name__} does not hand its block {local[0]} the previous block's output"
        " (neither the tensor nor `outputs[0]` of the block before it): it changes the hidden states between blocks,"
        " so a stage cannot start from the hidden states the previous stage sends. Pipeline another model family."
    )


def _base(model: nn.Module) -> nn.Module:
    prefix = base_prefix(model)
    return model.get_submodule(prefix) if prefix else model


def _per_layer_base(model: nn.Module, local: list[int], whole: bool) -> nn.Module | None:
    """The base model when it gives its blocks per-layer inputs (Gemma 4, Gemma 3n) and the model is split, else
    ``None``; refuses a stage whose layers reuse another stage's keys and values."""
    base = _base(model)
    if whole or not has_per_layer_inputs(base):
        return None
    check_shared_kv(base, local)
    return base


def _send_per_layer(out: Any, inputs: PerLayerInputs, exit_index: int, is_last: bool) -> Any:
    """A stage's output with, after the hidden states, the per-layer inputs of the layers after the stage."""
    if is_last or not inputs.active:
        return out
    hidden, *rest = out if isinstance(out, tuple) else (out,)
    return (hidden, inputs.to_send(exit_index), *rest)


def prepare_call(
    view: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], model: nn.Module | None = None
) -> dict[str, Any]:
    """The network call ``view(*args, **kwargs)`` by argument name, with ``use_cache=False``; refuses what a stage
    cannot compute (a cache of the whole model, every layer's hidden states or attentions). A decoding call made by
    ``generate`` under the pipeline carries the stage caches of its row chunk (:class:`.generation.StageCaches`):
    the stage runs with its own cache, ``use_cache=True``. ``model``: the transformers model ``view`` runs (``view``
    itself by default)."""
    call = _bind(view, args, kwargs)
    target = view if model is None else model
    name = cache_argument(call)
    if name is not None and isinstance(call[name], StageCaches):
        call[name] = call[name].of(view, target)
        _refuse_unsupported(target, {**call, name: None})
        call["use_cache"] = True
        return call
    _refuse_unsupported(target, call)
    call["use_cache"] = False
    return call


def _blocks(view: nn.Module) -> list[nn.Module]:
    stack = block_stack(view)
    keys = [key for key, _ in stack.named_children()]
    if isinstance(stack, nn.ModuleList) and keys != [str(i) for i in range(len(keys))]:
        # Forwards that pick a block's mask by its position in the list would silently pick another one.
        raise PipelineModelError(
            f"This stage of {type(view).__name__} holds blocks {keys} of its block list and nothing in place of the"
            " others: it was pruned without placeholders. Pass `placeholder=hf_placeholder(network)` to"
            " `surgery.prune` and `surgery.stage_view`."
        )
    return list(stack.children())


class _Entry:
    """The hooks that start a stage at its first block (index ``first``) with ``hidden``; the embedding's stand-in
    returns zeros shaped like ``like`` (``hidden``, or one stream of Gemma 3n's AltUp stack)."""

    def __init__(
        self, view: nn.Module, blocks: list[nn.Module], first: int, hidden: Tensor, style: str, like: Tensor
    ) -> None:
        self.view, self.blocks, self.first, self.hidden, self.like = view, blocks, first, hidden, like
        self.output = (hidden,) if style == "tuple" else hidden

    def install(self, stack: ExitStack) -> None:
        for block in self.blocks[: self.first]:
            _hook(stack, block.register_forward_hook(lambda module, args, output: self.output))
        # At block 0 (the previous stage held only what precedes the blocks) the forward hands it the stand-in
        # embedding's value: it takes the received hidden states instead, as the previous stage's exit saw them.
        check = self._check if self.first else self._replace
        # Ahead of the block's other pre-hooks: FSDP's (a stage sharded over data-parallel replicas) hands the block
        # new tensor objects for the inputs whose gradients it waits for, so the identity check must see the
        # forward's own argument, and FSDP must see the hidden states put in its place.
        block = self.blocks[self.first]
        _hook(stack, block.register_forward_pre_hook(check, with_kwargs=True, prepend=True))
        for absent in self.view.modules():
            if isinstance(absent, AbsentInput):
                absent.like = self.like
                stack.callback(setattr, absent, "like", None)

    def _check(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if _hidden_argument(args, kwargs) is not self.hidden:
            raise _WrongStyle

    def _replace(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": self.hidden}
        return (self.hidden, *args[1:]), kwargs


def _run(view: nn.Module, call: dict[str, Any], exit_block: nn.Module | None, entry: _Entry | None) -> Any:
    with ExitStack() as stack:
        if entry is not None:
            entry.install(stack)
        if exit_block is not None:
            _hook(stack, exit_block.register_forward_pre_hook(_leave, with_kwargs=True, prepend=True))
        try:
            out = view(**call)
        except _StageExit as leave:
            return leave.hidden
    if exit_block is not None:
        raise PipelineModelError(
            f"The forward of {type(view).__name__} returned without calling the next stage's first block, so this"
            " stage has nothing to send. Its forward must call every block of its pipeline plan's block list."
        )
    return out


def _leave(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    raise _StageExit(_hidden_argument(args, kwargs))


def _hook(stack: ExitStack, handle: RemovableHandle) -> None:
    stack.callback(handle.remove)


def _hidden_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


class _EmbeddingValues:
    """Raise if a value computed from the embedding stand-in's zeros reaches one of the stage's own ``blocks``.

    Tracks those values through every operator while the forward runs (a dispatch mode; once per stage: the check
    is about the model's code, not the data). Operators that read only their input's shape and dtype
    (``zeros_like``, ``new_empty``) do not pass it on.
    """

    def __init__(self, view: nn.Module, blocks: list[nn.Module]) -> None:
        self.view, self.blocks = view, blocks
        self.derived: dict[int, Tensor] = {}  # by id, holding the tensor so that its id is not reused
        self.depth = 0
        self.stack = ExitStack()

    def __enter__(self) -> _EmbeddingValues:
        for absent in self.view.modules():
            if isinstance(absent, AbsentInput):
                _hook(self.stack, absent.register_forward_hook(lambda module, args, out: self._mark([out])))
        for block in self.blocks:
            _hook(self.stack, block.register_forward_pre_hook(lambda module, args: self._enter()))
            _hook(self.stack, block.register_forward_hook(lambda module, args, out: self._leave()))
        self.stack.enter_context(torch_compat.operator_observer(self._observe))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()

    def _enter(self) -> None:
        self.depth += 1

    def _leave(self) -> None:
        self.depth -= 1

    def _mark(self, tensors: list[Any]) -> None:
        for t in tensors:
            if isinstance(t, Tensor):
                self.derived[id(t)] = t

    def _observe(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        inputs = torch_compat.tensors_of((args, kwargs))
        if not torch_compat.reads_values(func) or not any(id(t) in self.derived for t in inputs):
            return
        if self.depth > 0:
            raise PipelineModelError(
                f"The forward of {type(self.view).__name__} gives its blocks a value computed from the embeddings"
                f" ({torch_compat.op_name(func)} inside a block), besides the hidden states: on a stage after the"
                " first, the embedding belongs to another stage, so that value would be wrong. Pipeline another"
                " model family."
            )
        self._mark(torch_compat.tensors_of(out) + torch_compat.written_tensors(func, args, kwargs))


def _bind(view: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name, ``**kwargs`` flattened in."""
    signature = inspect.signature(view.forward)
    bound = signature.bind(*args, **kwargs)
    call: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            call.update(value)
        else:
            call[name] = value
    return call


def _refuse_unsupported(view: nn.Module, call: dict[str, Any]) -> None:
    name = cache_argument(call)
    if name is not None:
        raise PipelineUsageError(
            f"{type(view).__name__} was called with `{name}`: a pipeline stage holds only its own layers'"
            f" cache, so a cache passed in cannot be used. Call the model without `{name}` in the step; to"
            " decode, call `generate(...)` in validation, test or predict steps, where each stage keeps its own"
            " layers' cache."
        )
    for flag in ("output_hidden_states", "output_attentions"):
        if call.get(flag, getattr(view.config, flag, False)):
            raise PipelineUsageError(
                f"{type(view).__name__} was called with `{flag}=True` (or its config sets it): each pipeline stage"
                f" runs only its own layers, so the result would be incomplete. Pass `{flag}=False`."
            )


def _received(received: tuple[Tensor, ...] | Tensor | None) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The previous stage's hidden states, and the router logits carried with them (mixture-of-experts models)."""
    if isinstance(received, Tensor):
        return received, ()
    if not received or not all(isinstance(r, Tensor) for r in received):
        kind = None if received is None else [type(r).__name__ for r in received]
        raise PipelineUsageError(
            f"A stage of a transformers model after the first needs the previous stage's hidden states as a tensor,"
            f" got {kind}."
        )
    return received[0], tuple(received[1:])
