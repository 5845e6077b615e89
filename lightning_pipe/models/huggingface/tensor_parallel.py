"""Hugging Face ``transformers`` models cut across tensor-parallel processes, where the model's own plan says.

transformers gives many families a tensor-parallel plan: ``config.base_model_tp_plan`` for the base model's layers
(``"layers.*.self_attn.q_proj": "colwise"``, ...) and ``_tp_plan`` on the task model for the head (``"lm_head":
"colwise_rep"``, ``"colwise_gather_output"`` in transformers 5). This module reads it for the units one pipeline rank
holds and names, per module, the style to apply (:data:`STYLES`); :mod:`lightning_pipe.parallel.tensor_parallel`
turns the names into torch's ``ParallelStyle`` objects. Pure: no process group, no DTensor.

The blocks keep the model's own forward: transformers' attention reshapes projections with ``view(..., -1,
head_dim)``, so a rank computes its own heads, and its output projection ("rowwise") sums them over the ranks.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from lightning_pipe.compat.transformers import head_tp_plan
from lightning_pipe.errors import PipelineConfigError, PipelineModelError
from lightning_pipe.models.huggingface.plan import base_prefix

#: The plan's style names lightning-pipe applies, and what each means (transformers 4.54-4.57 and 5.x spellings).
STYLES: dict[str, str] = {
    "colwise": "output features split over the ranks; each rank's output is its part",
    "rowwise": "input features split; the partial outputs summed over the ranks",
    "colwise_rep": "output features split, the whole output gathered on every rank",
    "colwise_gather_output": "output features split, the whole output gathered on every rank",
    "rowwise_rep": "a whole input split locally; the partial outputs summed over the ranks",
    "rowwise_split_input": "a whole input split locally; the partial outputs summed over the ranks",
    "replicated_with_grad_allreduce": "kept whole on every rank, its gradient summed over the ranks",
    "embedding_rowwise": "the vocabulary split over the ranks; the partial embeddings summed",
    "vocab_parallel_embedding": "the vocabulary split over the ranks (a tied embedding, sharded like its head)",
}
#: Attention head counts each tensor-parallel rank must hold whole.
HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")


def full_plan(network: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan with names relative to ``network``: the base model's entries, prefixed, and
    the task model's own (the head; in transformers 5 also a tied embedding's)."""
    config = network.config  # type: ignore[attr-defined]
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not base:
        raise PipelineModelError(
            f"{type(network).__name__} has no tensor-parallel plan (`{type(config).__name__}.base_model_tp_plan` is"
            " empty in this transformers version), so `tensor_parallel > 1` cannot split its layers. Use a family"
            " that has one (Llama, Mistral, Qwen2, ...), or build the model in `__init__` and apply your own"
            " `parallelize_module` plan in `configure_model` with `self.device_mesh['tp']`."
        )
    prefix = base_prefix(network)
    plan = {(f"{prefix}.{name}" if prefix else name): style for name, style in base.items()}
    for name, style in head_tp_plan(network).items():
        plan.setdefault(name, style)
    return plan


def _refuse_gemma3n(network: nn.Module) -> None:
    """Gemma 3n: its sparse MLPs' threshold is a statistic over the width the plan shards; refused whole (a pattern
    of zeros leaves AltUp and the per-layer inputs, outside its plan, untested under tensor parallelism)."""
    config = network.config  # type: ignore[attr-defined]
    if getattr(config, "model_type", None) != "gemma3n_text":
        return
    pattern = list(getattr(config, "activation_sparsity_pattern", None) or ())
    raise PipelineModelError(
        f"Tensor parallelism is not applied to {type(network).__name__} (model_type 'gemma3n_text'): its MLPs with"
        f" activation sparsity (`activation_sparsity_pattern`, here {pattern[:4]}{' ...' if len(pattern) > 4 else ''})"
        " cut the gate projection at its mean plus a multiple of its standard deviation over the intermediate width"
        " that the plan shards, so each rank would cut at its own threshold. Use `tensor_parallel=1` for Gemma 3n"
        " (pipeline and data parallelism train it exactly)."
    )


def check_plan(network: nn.Module, plan: dict[str, str], tensor_parallel: int) -> None:
    """Refuse a plan this strategy cannot apply exactly, and head counts the ranks cannot share."""
    _refuse_gemma3n(network)
    unsupported = {name: style for name, style in plan.items() if style not in STYLES}
    if unsupported:
        shown = ", ".join(f"{name!r}: {style!r}" for name, style in sorted(unsupported.items())[:4])
        raise PipelineModelError(
            f"The tensor-parallel plan of {type(network).__name__} uses styles lightning-pipe does not apply ({shown});"
            f" supported: {', '.join(sorted(s for s in STYLES if s != 'vocab_parallel_embedding'))}. Build the model"
            " in `__init__` and apply your own `parallelize_module` plan in `configure_model`, or use"
            " `tensor_parallel=1` for this model."
        )
    config = network.config  # type: ignore[attr-defined]
    for attr in HEAD_COUNTS:
        count = getattr(config, attr, None)
        if isinstance(count, int) and count % tensor_parallel != 0:
            raise PipelineConfigError(
                f"`tensor_parallel={tensor_parallel}` does not divide `{attr}={count}` of {type(config).__name__}:"
                " each tensor-parallel process computes whole attention heads. Use a `tensor_parallel` that divides"
                f" {', '.join(f'{a}={getattr(config, a)}' for a in HEAD_COUNTS if hasattr(config, a))}."
            )


def _pattern(name: str) -> re.Pattern[str]:
    # "layers.*.self_attn.q_proj": a star stands for one name component (a block's index).
    return re.compile("^" + re.escape(name).replace(r"\*", r"[^.]+") + "$")


def hf_tensor_parallel_plan(
    network: nn.Module, tensor_parallel: int, shared: list[tuple[str, ...]] | tuple[()] = ()
) -> dict[str, str]:
    """``{module name in network: style}`` for the modules of the model's plan that ``network`` (cut to this rank's
    stages) holds, after :func:`check_plan`.

    ``shared`` lists the names of parameters the model ties (before the split): an embedding tied to a head the plan
    splits is made vocabulary-parallel (``"vocab_parallel_embedding"``), sharded like the head, so the tie holds
    (the parameter is one tensor whatever its layout) and its copies on other stages add up shard by shard.
    """
    plan = full_plan(network)
    check_plan(network, plan, tensor_parallel)
    patterns = [(_pattern(name), style) for name, style in plan.items()]
    # Modules with parameters of their own: the stand-ins of other stages' units (which may mirror a block's children)
    # have none.
    held = {
        name: m for name, m in network.named_modules() if name and next(m.parameters(recurse=False), None) is not None
    }
    chosen: dict[str, str] = {}
    for name in held:
        for pattern, style in patterns:
            if pattern.match(name):
                chosen[name] = style
                break
    # Modules the plan splits by name (the head), not by pattern (the blocks' layers).
    split = {name for name, style in plan.items() if "*" not in name and style != "replicated_with_grad_allreduce"}
    for names in shared:
        modules = [n.rpartition(".")[0] for n in names]
        if any(m in split for m in modules):
            for module in modules:
                if module not in split and isinstance(held.get(module), nn.Embedding):
                    chosen[module] = "vocab_parallel_embedding"
    return chosen


def describe(chosen: dict[str, Any]) -> str:
    """A short account of a chosen plan for the log: styles and how many modules each."""
    counts: dict[str, int] = {}
    for style in chosen.values():
        counts[style] = counts.get(style, 0) + 1
    return ", ".join(f"{n} {style}" for style, n in sorted(counts.items()))
