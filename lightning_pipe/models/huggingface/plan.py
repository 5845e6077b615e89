"""Unmodified Hugging Face ``transformers`` models as pipeline stages, cut where the model's own pipeline plan says.

transformers gives each model family a pipeline plan: ``config.base_model_pp_plan`` for the base model
(``embed_tokens``, ``layers``, ``norm``) and ``_pp_plan`` on the task model (``lm_head``). Its units
(:func:`hf_layout`) are the plan's modules with parameters; a stage holds some of them, and stand-ins take the place
of the others (:func:`hf_placeholder`), so the model's own forward runs on every stage: how a stage enters and leaves
it is :mod:`lightning_pipe.models.huggingface.stage`.

Some families cannot be cut at block boundaries; they are refused by name, with the reason (:data:`UNSUPPORTED`).

``transformers`` is an optional dependency: nothing here imports it at module level.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.compat import torch as torch_compat
from lightning_pipe.compat.transformers import head_pp_plan, set_head_pp_plan
from lightning_pipe.errors import PipelineConfigError, PipelineModelError
from lightning_pipe.models.base import Placeholder
from lightning_pipe.models.huggingface import altup
from lightning_pipe.models.huggingface.heads import HEAD_SPEC, task_heads
from lightning_pipe.models.huggingface.per_layer import plan_entries, shared_kv_ranges
from lightning_pipe.models.huggingface.vision import vision_plan
from lightning_pipe.models.units import CONTAINERS, Layout

MIN_TRANSFORMERS = "4.54"
"""The oldest transformers CI tests the families with (``.ci/run``)."""

UNSUPPORTED = {
    "glm_moe_dsa": "its blocks hand the next block their top-k attention indices besides the hidden states"
    " (`hidden_states, topk_indices = decoder_layer(...)`), and a stage sends the next one the hidden states only",
    "hrm_text": "it runs its two block stacks several times per forward (recurrent cycles), so its blocks do not run"
    " once each, in order, as pipeline stages do",
}
"""Families (``config.model_type``) whose forward cannot be cut at block boundaries, with the reason. The others that
carry a pipeline plan are cut exactly: tests/hf_families.py checks every one transformers registers."""

_Plan = dict[str, tuple[list[str], list[str]]]


def is_hf_model(network: nn.Module) -> bool:
    """Whether ``network`` is a transformers ``PreTrainedModel`` (without importing transformers)."""
    # No transformers model exists before transformers imported its modeling code, so a non-HF network costs no import.
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(network, modeling.PreTrainedModel)


class PassThrough(nn.Module):
    """Stands in for a block another stage holds: returns its input ``name`` (or its first positional argument).

    The forward calls every block; the stage call (:mod:`lightning_pipe.models.huggingface.stage`) hooks these
    stand-ins to enter the stage at its first block and leave it before the next stage's. ``attributes`` are the
    replaced block's plain attributes: some forwards read one from every block (transformers 4.x Qwen2 picks each
    block's mask by ``decoder_layer.attention_type``).
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


class AbsentInput(nn.Module):
    """Stands in for a unit before the blocks (the embedding) on a stage that does not hold it.

    It returns zeros shaped like the hidden states the stage received (``like``, set by the stage call for the
    call's duration), so the forward computes its masks and position embeddings as on the first stage; the values,
    and whatever the forward does to them (Gemma's sqrt(hidden_size) scale, Granite's multiplier), are dropped where
    the stage's first block takes the received hidden states instead.
    """

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit
        self.like: Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        if self.like is None:
            raise PipelineModelError(
                f"`{self.unit}` belongs to another pipeline stage and was called outside this stage's call; call the"
                " network from a LightningModule step run by the pipeline strategy."
            )
        return torch.zeros_like(self.like)

    def extra_repr(self) -> str:
        return self.unit


class AbsentOutput(nn.Module):
    """Stands in for a unit after the blocks (final norm, head) on a stage before the last: the stage leaves the
    forward at the next stage's first block, so reaching this means the forward skipped that block."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineModelError(
            f"The forward reached `{self.unit}`, which belongs to the last pipeline stage, without calling the next"
            " stage's first block, so this stage has nothing to send. The forward must call every block of its"
            " pipeline plan's block list, in order (check `config.num_hidden_layers`)."
        )

    def extra_repr(self) -> str:
        return self.unit


def _plain_attributes(module: nn.Module, depth: int = 2) -> dict[str, Any]:
    """The module's plain attributes, and its children's as namespaces (transformers 4.57 OLMo-3 picks each block's
    mask by ``decoder_layer.self_attn.attention_type``)."""
    plain: dict[str, Any] = {
        key: value
        for key, value in vars(module).items()
        if not key.startswith("_") and key != "training" and isinstance(value, (str, int, float, bool, type(None)))
    }
    if depth > 1:
        for name, child in module.named_children():
            plain[name] = SimpleNamespace(**_plain_attributes(child, depth - 1))
    return plain


def base_prefix(network: nn.Module) -> str:
    """The attribute holding a task model's base model (``"model"``), ``""`` for a base model: the one answer the
    pipeline plan, the tensor-parallel plan and the weight names all use.

    ``base_model_prefix`` when it names a submodule that holds the base plan's modules; else, for a model with a
    pipeline plan, the child that holds them (4.54's Gemma3ForCausalLM says ``language_model`` but keeps it in
    ``model``).
    """
    base_plan = getattr(getattr(network, "config", None), "base_model_pp_plan", None) or {}
    prefix = getattr(network, "base_model_prefix", "") or ""
    candidates = [prefix] if prefix else []
    if base_plan:
        candidates += [name for name, _ in network.named_children() if name != prefix]
    for name in candidates:
        base = _find(network, name)
        if base is not None and base is not network and all(_has_slot(base, entry) for entry in base_plan):
            return name
    return ""


def _plan(network: nn.Module) -> _Plan:
    """The model's pipeline plan in execution order, with names relative to ``network``.

    The base model's plan runs first and the task model's own entries (heads) after it: transformers merges them in
    the other order (``LlamaForCausalLM.pp_plan`` starts with ``lm_head``).
    """
    composite = vision_plan(network)
    if composite is not None:  # a vision-language model: its text model's plan
        return composite
    base_plan = dict(getattr(network.config, "base_model_pp_plan", None) or {})
    prefix = base_prefix(network)
    plan: _Plan = {(f"{prefix}.{name}" if prefix else name): spec for name, spec in base_plan.items()}
    plan = _with_per_layer_modules(network, prefix, plan)
    for name, spec in head_pp_plan(network).items():
        if not (prefix and name.startswith(prefix + ".")) and _find(network, name) is not None:
            plan.setdefault(name, spec)
    for name in task_heads(network, prefix):  # transformers' plan names no task head but the causal LM's
        plan.setdefault(name, HEAD_SPEC)
    return {name: (list(spec[0]), list(spec[1])) for name, spec in plan.items()}


def _with_per_layer_modules(network: nn.Module, prefix: str, plan: _Plan) -> _Plan:
    """``plan`` with the modules outside transformers' plan that a family runs around its block list: before it, the
    modules that compute per-layer inputs (Gemma 4, Gemma 3n: :mod:`.per_layer`) and AltUp's projections that build
    the stack of streams (Gemma 3n); after it, AltUp's projections that merge the stack back (:mod:`.altup`)."""
    base = _find(network, prefix) if prefix else network
    if base is None:
        return plan
    before, after = altup.plan_entries(base)
    before, after = _under(prefix, plan_entries(base) + before), _under(prefix, after)
    if not before and not after:
        return plan
    stack = next((name for name in plan if isinstance(_find(network, name), CONTAINERS)), None)
    ordered: _Plan = {}
    for name, spec in plan.items():
        if name == stack:
            ordered.update({entry: ([], []) for entry in before})
        ordered[name] = spec
        if name == stack:
            ordered.update({entry: ([], []) for entry in after})
    return ordered


def _under(prefix: str, names: list[str]) -> list[str]:
    return [f"{prefix}.{name}" if prefix else name for name in names]


def _require_plan(network: nn.Module) -> _Plan:
    _check_version()
    model_type = getattr(network.config, "model_type", "")
    if model_type in UNSUPPORTED:
        raise PipelineModelError(
            f"{type(network).__name__} (model_type {model_type!r}) cannot be pipelined: {UNSUPPORTED[model_type]}."
            " Pipeline another model family, or train it with another strategy."
        )
    if not getattr(network.config, "base_model_pp_plan", None) and getattr(network.config, "is_encoder_decoder", False):
        raise PipelineModelError(
            f"{type(network).__name__} is an encoder-decoder without a pipeline plan of its own: every decoder layer"
            " reads the encoder's output, which the default frontend cannot pass from stage to stage. Pass"
            " `frontend='dataflow'`, which sends each value to the stages that read it."
        )
    if not getattr(network.config, "base_model_pp_plan", None) and vision_plan(network) is None:
        raise PipelineModelError(
            f"{type(network).__name__} has no pipeline plan (`{type(network.config).__name__}.base_model_pp_plan` is"
            " empty in this transformers version), so lightning-pipe cannot tell where to cut it. Use a model"
            " family that has one (Llama, Qwen2, Mistral, ...), or give the strategy its plan:"
            " `PipelineParallelStrategy(model_plan={...})` (docs/model-plan.md)."
        )
    return _plan(network)


def _check_version() -> None:
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise PipelineModelError(
            f"transformers {transformers.__version__} is installed, but pipelining a transformers model needs"
            f" transformers>={MIN_TRANSFORMERS} (the oldest version tested). Run"
            f" `pip install 'transformers>={MIN_TRANSFORMERS}'` (or `pip install 'lightning-pipe[hf]'`)."
        )


def _block_stack(network: nn.Module, plan: _Plan) -> str:
    missing = [name for name in plan if not _has_slot(network, name)]
    if missing:
        raise PipelineModelError(
            f"The pipeline plan of {type(network).__name__} names {missing}, which the model does not have, so"
            " lightning-pipe cannot tell where its blocks are. Pipeline another model family, or set"
            " `config.base_model_pp_plan` to the modules the model holds (embedding, block list, final norm)."
        )
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


def install_plan(network: nn.Module, plan: _Plan) -> None:
    """Give ``network``, a transformers model whose family has no pipeline plan, the user's plan (the strategy's
    ``model_plan``): names relative to ``network``, in execution order, as ``(inputs, outputs)``.

    The entries under the base model (``model.layers``) become the config's ``base_model_pp_plan`` without the base
    model's prefix, the others (the head) the instance's ``_pp_plan``: where transformers keeps a family's own plan,
    so every stage reads it as it reads theirs. ``save_pretrained`` writes neither. Giving the same plan again does
    nothing, as does transformers' own plan; a model with another plan of its own is refused (``model_plan``
    describes families that have none).
    """
    name = type(network).__name__
    prefix = getattr(network, "base_model_prefix", "") or ""
    base = _find(network, prefix) if prefix else None
    prefix = prefix if base is not None and base is not network else ""
    own = {k: v for k, v in plan.items() if not prefix or k.startswith(prefix + ".")}
    base_entries = {k[len(prefix) + 1 :] if prefix else k: (list(v[0]), list(v[1])) for k, v in own.items()}
    heads = {k: (list(v[0]), list(v[1])) for k, v in plan.items() if k not in own}
    current = getattr(network.config, "base_model_pp_plan", None)
    if current and {k: (list(v[0]), list(v[1])) for k, v in current.items()} == base_entries:
        return  # installed before (the tuner's look at the layout, an earlier Trainer)
    if current or vision_plan(network) is not None:
        raise PipelineConfigError(
            f"`model_plan` was given, but {name} has a pipeline plan of its own"
            f" (`{type(network.config).__name__}.base_model_pp_plan` or its text model's), so lightning-pipe would"
            " not know which to follow. Drop `model_plan`: it describes model families whose config has none."
        )
    missing = [key for key in plan if not _has_slot(network, key)]
    if missing:
        children = [child for child, _ in network.named_modules() if child and child.count(".") <= 1][:8]
        raise PipelineConfigError(
            f"`model_plan` names {missing}, which {name} does not have. Name its modules relative to the model, as"
            f" `{name}.named_modules()` gives them (here: {children})."
        )
    network.config.base_model_pp_plan = base_entries
    set_head_pp_plan(network, heads)


def plan_order(network: nn.Module) -> list[str]:
    """The entries of the model's pipeline plan in execution order, relative to ``network``; raises
    ``PipelineModelError`` for a model without a plan."""
    return list(_require_plan(network))


def _find(network: nn.Module, name: str) -> nn.Module | None:
    try:
        return network.get_submodule(name)
    except AttributeError:
        return None


def _has_slot(network: nn.Module, name: str) -> bool:
    """Whether ``network`` has a submodule slot ``name``, empty (``None``, another stage's unit) or not."""
    parent, _, leaf = name.rpartition(".")
    owner = _find(network, parent) if parent else network
    return owner is not None and leaf in torch_compat.children(owner)


def _has_params(module: nn.Module | None) -> bool:
    return module is not None and any(True for _ in module.parameters())


def block_stack(network: nn.Module) -> nn.Module:
    """The module holding the model's blocks (``model.layers``)."""
    return network.get_submodule(_block_stack(network, _plan(network)))


def hf_layout(network: nn.Module) -> Layout:
    """The units of a transformers model, from its pipeline plan.

    E.g. ``model.embed_tokens``; ``model.layers.0``, ``model.layers.1``, ...; ``model.norm``, ``lm_head``. Plan
    entries without parameters (dropouts) are not units and stay on every stage, as do modules outside the plan
    without parameters (rotary embeddings). Raises ``PipelineModelError`` for a model without a plan, a family in
    :data:`UNSUPPORTED`, or parameters outside the plan.
    """
    plan = _require_plan(network)
    stack = _block_stack(network, plan)
    names = list(plan)
    at = names.index(stack)
    pre = tuple(name for name in names[:at] if _has_params(_find(network, name)))
    post = tuple(name for name in names[at + 1 :] if _has_params(_find(network, name)))
    blocks = tuple(f"{stack}.{key}" for key, child in network.get_submodule(stack).named_children())
    prefix = base_prefix(network)
    base = _find(network, prefix) if prefix else network
    together = shared_kv_ranges(base) if base is not None else ()  # layers reading another layer's keys and values
    layout = Layout(pre=pre, blocks=blocks, post=post, together=together)
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
    """What stands in for a unit on stages that do not hold it, for ``surgery.prune``/``surgery.stage_view``.

    Blocks become :class:`PassThrough` (the forward calls every one of them, and some families pick each block's
    mask by its position in the list), units before the blocks :class:`AbsentInput`, units after them (final norm,
    head) :class:`AbsentOutput`: a stage leaves the forward before reaching them unless it holds them. Call it on the
    whole
    network, before pruning: block placeholders copy the blocks' plain attributes.
    """
    plan = _require_plan(network)
    stack = _block_stack(network, plan)
    names = list(plan)
    before = set(names[: names.index(stack)])
    attributes = {
        f"{stack}.{key}": _plain_attributes(block) for key, block in network.get_submodule(stack).named_children()
    }
    inputs = plan[stack][0]
    name = inputs[0] if inputs else "hidden_states"

    def placeholder(unit: str) -> nn.Module | None:
        if unit.rpartition(".")[0] == stack:
            return PassThrough(name, attributes.get(unit))
        return AbsentInput(unit) if unit in before else AbsentOutput(unit)

    return placeholder


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
