"""Unmodified Hugging Face ``transformers`` models as pipeline stages, cut where the model's own pipeline plan says.

transformers gives each model family a pipeline plan: ``config.base_model_pp_plan`` for the base model
(``embed_tokens``, ``layers``, ``norm``) and ``_pp_plan`` on the task model (``lm_head``). Its forward already has
the two entry points a stage needs, so no model code changes:

- a stage after the first calls the forward with ``inputs_embeds=<received hidden states>``, so the embedding is
  skipped;
- a stage before the last calls the base model (no head, no loss) and sends its ``last_hidden_state``;
- the last stage calls the whole model, so logits, loss and the output class are exactly the model's own.

On a stage, the blocks of other stages and the final norm are pass-through placeholders (``hf_placeholder``): the
forward calls every one of them, and some families pick each block's attention mask by its position in the list.

``transformers`` is an optional dependency: nothing here imports it at module level.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.compat.transformers import head_pp_plan
from lightning_pipe.errors import PipelineModelError, PipelineUsageError
from lightning_pipe.split import router_logits
from lightning_pipe.split.partition import CONTAINERS, Layout
from lightning_pipe.split.surgery import Placeholder

MIN_TRANSFORMERS = "4.54"
"""Blocks return the hidden states tensor (not a tuple) from this version on; the placeholders rely on it."""

_Plan = dict[str, tuple[list[str], list[str]]]


def is_hf_model(network: nn.Module) -> bool:
    """Whether ``network`` is a transformers ``PreTrainedModel`` (without importing transformers)."""
    # No transformers model exists before transformers imported its modeling code, so a non-HF network costs no import.
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(network, modeling.PreTrainedModel)


class PassThrough(nn.Module):
    """Stands in for a unit another stage holds: returns its input ``name`` (or its first positional argument).

    ``attributes`` are the replaced unit's plain attributes: some forwards read one from every block (transformers
    4.x Qwen2 picks each block's mask by ``decoder_layer.attention_type``).
    """

    def __init__(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.name = name
        for key, value in (attributes or {}).items():
            setattr(self, key, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return kwargs[self.name] if self.name in kwargs else args[0]

    def extra_repr(self) -> str:
        return self.name


def _plain_attributes(module: nn.Module) -> dict[str, Any]:
    return {
        key: value
        for key, value in vars(module).items()
        if not key.startswith("_") and key != "training" and isinstance(value, (str, int, float, bool, type(None)))
    }


def _base_prefix(network: nn.Module) -> str:
    prefix = getattr(network, "base_model_prefix", "")
    base = getattr(network, prefix, None) if prefix else None
    return prefix if isinstance(base, nn.Module) and base is not network else ""


def _plan(network: nn.Module) -> _Plan:
    """The model's pipeline plan in execution order, with names relative to ``network``.

    The base model's plan runs first and the task model's own entries (heads) after it: transformers merges them in
    the other order (``LlamaForCausalLM.pp_plan`` starts with ``lm_head``).
    """
    prefix = _base_prefix(network)
    base_plan = dict(getattr(network.config, "base_model_pp_plan", None) or {})
    plan: _Plan = {(f"{prefix}.{name}" if prefix else name): spec for name, spec in base_plan.items()}
    # The heads are in the class's `_pp_plan`; the instance's adds the user's changes, and also the base model's
    # entries, prefixed (transformers >= 5) or not (4.x, whose `post_init` drops the class's heads from it).
    heads = head_pp_plan(network)
    for name, spec in heads.items():
        if not (prefix and name.startswith(prefix + ".")) and _find(network, name) is not None:
            plan.setdefault(name, spec)
    return {name: (list(spec[0]), list(spec[1])) for name, spec in plan.items()}


def _require_plan(network: nn.Module) -> _Plan:
    _check_version()
    if not getattr(network.config, "base_model_pp_plan", None) and getattr(network.config, "is_encoder_decoder", False):
        raise PipelineModelError(
            f"{type(network).__name__} is an encoder-decoder without a pipeline plan of its own: every decoder layer"
            " reads the encoder's output, which the default frontend cannot pass from stage to stage. Pass"
            " `frontend='dataflow'`, which sends each value to the stages that read it."
        )
    if not getattr(network.config, "base_model_pp_plan", None):
        raise PipelineModelError(
            f"{type(network).__name__} has no pipeline plan (`{type(network.config).__name__}.base_model_pp_plan` is"
            " empty in this transformers version), so lightning-pipe cannot tell where to cut it. Use a model"
            " family that has one (Llama, Qwen2, Mistral, ...), or set `config.base_model_pp_plan` (and the class's"
            " `_pp_plan` for the head) as LlamaConfig and LlamaForCausalLM do."
        )
    return _plan(network)


def _check_version() -> None:
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise PipelineModelError(
            f"transformers {transformers.__version__} is installed, but pipelining a transformers model needs"
            f" transformers>={MIN_TRANSFORMERS} (earlier blocks return tuples). Run"
            f" `pip install 'transformers>={MIN_TRANSFORMERS}'` (or `pip install 'lightning-pipe[hf]'`)."
        )


def _block_stack(network: nn.Module, plan: _Plan) -> str:
    stacks = [name for name in plan if isinstance(_find(network, name), CONTAINERS)]
    if len(stacks) > 1:
        raise PipelineModelError(
            f"The pipeline plan of {type(network).__name__} names {len(stacks)} block lists ({stacks}): an encoder and"
            " a decoder, whose every layer reads the encoder's output. The default frontend passes one activation"
            " from stage to stage; pass `frontend='dataflow'`, which sends each value to the stages that read it."
        )
    if not stacks:
        raise PipelineModelError(
            f"The pipeline plan of {type(network).__name__} names no block list; lightning-pipe needs one (an"
            " nn.ModuleList such as `model.layers`). Set `config.base_model_pp_plan` to name the blocks that run in"
            " sequence, or pipeline another model family."
        )
    return stacks[0]


def plan_order(network: nn.Module) -> list[str]:
    """The entries of the model's pipeline plan in execution order, relative to ``network``; raises
    ``PipelineModelError`` for a model without a plan."""
    return list(_require_plan(network))


def _find(network: nn.Module, name: str) -> nn.Module | None:
    try:
        return network.get_submodule(name)
    except AttributeError:
        return None


def _has_params(module: nn.Module | None) -> bool:
    return module is not None and any(True for _ in module.parameters())


def hf_layout(network: nn.Module) -> Layout:
    """The units of a transformers model, from its pipeline plan.

    E.g. ``model.embed_tokens``; ``model.layers.0``, ``model.layers.1``, ...; ``model.norm``, ``lm_head``. Plan
    entries without parameters (dropouts) are not units and stay on every stage, as do modules outside the plan
    without parameters (rotary embeddings). Raises ``PipelineModelError`` for a model without a plan, or with
    parameters outside it.
    """
    plan = _require_plan(network)
    stack = _block_stack(network, plan)
    names = list(plan)
    at = names.index(stack)
    pre = tuple(name for name in names[:at] if _has_params(_find(network, name)))
    post = tuple(name for name in names[at + 1 :] if _has_params(_find(network, name)))
    blocks = tuple(f"{stack}.{key}" for key, child in network.get_submodule(stack).named_children())
    layout = Layout(pre=pre, blocks=blocks, post=post)
    _check_coverage(network, layout)
    return layout


def _check_coverage(network: nn.Module, layout: Layout) -> None:
    prefixes = tuple(unit + "." for unit in layout.units)
    for name, _ in network.named_parameters(remove_duplicate=False):
        if not name.startswith(prefixes):
            raise PipelineModelError(
                f"Parameter {name!r} of {type(network).__name__} lies outside the model's pipeline plan"
                f" ({', '.join(layout.pre + layout.post)} and the blocks of {layout.blocks[0].rpartition('.')[0]}),"
                " so no stage would hold it. Pipeline a model class that the plan covers (e.g. the ...ForCausalLM"
                " class), or add the module to `config.base_model_pp_plan`."
            )


def hf_placeholder(network: nn.Module) -> Placeholder:
    """What stands in for a unit on stages that do not hold it, for ``stages.prune``/``stages.stage_view``.

    Blocks, and units whose plan output is one of their inputs (the final norm), become ``PassThrough``: the forward
    calls them on every stage. The others (embedding, head) become ``None``: the stage call never reaches them, and
    a call that did would fail instead of computing logits from hidden states. Call it on the whole network, before
    pruning: block placeholders copy the blocks' plain attributes.
    """
    plan = _require_plan(network)
    stack = _block_stack(network, plan)
    attributes = {
        f"{stack}.{key}": _plain_attributes(block) for key, block in network.get_submodule(stack).named_children()
    }
    passes = {
        name: outputs[0] for name, (inputs, outputs) in plan.items() if len(outputs) == 1 and outputs[0] in inputs
    }

    def placeholder(unit: str) -> nn.Module | None:
        parent = unit.rpartition(".")[0]
        key = stack if parent == stack else unit
        return PassThrough(passes[key], attributes.get(unit)) if key in passes else None

    return placeholder


def hf_stage_call(
    view: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    received: tuple[Tensor, ...] | Tensor | None,
    is_first: bool,
    is_last: bool,
) -> Any:
    """Run one stage of a transformers model on one microbatch of the network call ``view(*args, **kwargs)``.

    The first stage starts from the call's ``input_ids`` (or ``inputs_embeds``), later stages from
    ``inputs_embeds=received``; every stage uses the call's masks and position ids, with ``use_cache=False``.
    Stages before the last return the hidden states tensor; the last returns what the call returns on one device
    (``CausalLMOutputWithPast`` with ``loss`` when ``labels`` are given).
    """
    call = prepare_call(view, args, kwargs)
    hidden, carried = None, ()
    if not is_first:
        hidden, carried = _received(received)
        call.pop("input_ids", None)
        call["inputs_embeds"] = hidden
    base = getattr(view, "base_model", view)
    if is_last:
        with (
            _boundary_checks(view, entry=hidden, record_exit=False),
            router_logits.prepended(view, base, call, carried),
        ):
            return view(**call)
    with _boundary_checks(view, entry=hidden, record_exit=True) as exits:
        outputs = base(**_base_call(view, base, call))
    out = outputs[0]
    if out is not exits[-1]:
        raise PipelineModelError(
            f"The forward of {type(base).__name__} does not return its last block's output"
            f" ({type(exits[-1]).__name__}) as its hidden states: it changes them outside the units of its pipeline"
            f" plan, or its blocks return tuples (transformers < {MIN_TRANSFORMERS}). A stage would send other"
            " activations than the model computes. Upgrade transformers or pipeline another model family."
        )
    return router_logits.stage_output(view, call, out, outputs, carried)


def prepare_call(view: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The network call ``view(*args, **kwargs)`` by argument name, with ``use_cache=False``; refuses what a stage
    cannot compute (cached decoding, every layer's hidden states or attentions)."""
    call = _bind(view, args, kwargs)
    _refuse_unsupported(view, call)
    call["use_cache"] = False
    return call


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


def _base_call(view: nn.Module, base: nn.Module, call: dict[str, Any]) -> dict[str, Any]:
    """The arguments the task model's forward would pass to its base model: all but its own (``labels``, ...)."""
    if base is view:
        return call
    own = set(inspect.signature(view.forward).parameters) - set(inspect.signature(base.forward).parameters)
    return {name: value for name, value in call.items() if name not in own}


def _refuse_unsupported(view: nn.Module, call: dict[str, Any]) -> None:
    if call.get("past_key_values") is not None:
        raise PipelineUsageError(
            f"{type(view).__name__} was called with `past_key_values`: a pipeline stage holds only its own layers'"
            " cache, so cached decoding is not supported. Call the model without `past_key_values` in the step."
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


@contextmanager
def _boundary_checks(view: nn.Module, entry: Tensor | None, record_exit: bool) -> Iterator[list[Any]]:
    """Check that the stage's first block receives ``entry`` itself, and record its last block's outputs.

    The stage call relies on the base model feeding ``inputs_embeds`` unchanged to its blocks, as the pipeline
    plan declares. A forward that scales or adds to it first (Gemma before transformers 5.4 multiplies it by
    sqrt(hidden_size)) would repeat that on every stage: refuse it instead of training on other activations.
    """
    plan = _plan(view)
    stack = view.get_submodule(_block_stack(view, plan))
    keys = [key for key, _ in stack.named_children()]
    if isinstance(stack, nn.ModuleList) and keys != [str(i) for i in range(len(keys))]:
        # Forwards that pick a block's mask by its position in the list would silently pick another one.
        raise PipelineModelError(
            f"This stage of {type(view).__name__} holds blocks {keys} of its block list and nothing in place of the"
            " others: it was pruned without placeholders. Pass `placeholder=hf_placeholder(network)` to"
            " `stages.prune` and `stages.stage_view`."
        )
    local = [block for block in stack.children() if not isinstance(block, PassThrough)]
    exits: list[Any] = []
    handles = []

    def check_entry(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        if first is not entry:
            raise PipelineModelError(
                f"The forward of {type(view).__name__} does not pass `inputs_embeds` unchanged to its first block"
                f" ({type(module).__name__}), so a stage after the first cannot start from the hidden states it"
                " receives. Upgrade transformers (`pip install -U transformers`: Gemma needs >= 5.4) or pipeline"
                " another model family."
            )

    if entry is not None:
        handles.append(local[0].register_forward_pre_hook(check_entry, with_kwargs=True))
    if record_exit:
        handles.append(local[-1].register_forward_hook(lambda module, args, output: exits.append(output)))
    try:
        yield exits
    finally:
        for handle in handles:
            handle.remove()


def restore_rotary_buffers(module: nn.Module) -> bool:
    """Recompute a Hugging Face rotary embedding's ``inv_freq`` from its config; ``True`` if ``module`` is one.

    ``inv_freq`` is a non-persistent buffer computed in ``__init__``: built on the meta device it has no values, and
    transformers 4.x's ``_init_weights`` does not set it (5.x does).
    """
    init = getattr(module, "rope_init_fn", None)
    config = getattr(module, "config", None)
    inv_freq = getattr(module, "inv_freq", None)
    if not callable(init) or config is None or not isinstance(inv_freq, torch.Tensor):
        return False
    values, _scaling = init(config, inv_freq.device)
    with torch.no_grad():
        inv_freq.copy_(values.to(inv_freq.dtype))
    if hasattr(module, "original_inv_freq"):
        module.original_inv_freq = inv_freq
    return True
