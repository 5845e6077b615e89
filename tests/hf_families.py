"""Every causal-LM family that transformers registers with a pipeline plan, as a tiny model.

The families come from transformers' own registry (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, keeping the configs with a
``base_model_pp_plan``), so a new transformers version brings its new families into the tests by itself. Each gets
a tiny config (hidden size 32, 4 layers, vocabulary 61, no dropout) from one generic shrinker.

``python -m tests.hf_families`` prints the family matrix of the installed transformers (docs/huggingface.md):
every family, whether a 2- and 4-stage split reproduces the unsplit model's logits and gradients, or why not.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch

VOCAB, SEQ = 61, 9

#: Sizes set wherever the family's config has the attribute.
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    sliding_window=4,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    # mixture of experts
    moe_intermediate_size=16,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    shared_expert_intermediate_size=16,
    # multi-head latent attention (DeepSeek)
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    # per-layer inputs (Gemma 3n, Gemma 4): a table of vocabulary x layers x this width
    vocab_size_per_layer_input=VOCAB,
    hidden_size_per_layer_input=8,
    num_kv_shared_layers=0,  # layers reading another layer's keys and values: tests/test_hf_families.py
)

#: Families with blocks whose outputs the 4.x forward unpacks, with embedding scales or multipliers, parameter-free
#: norms, parallel attention, mixtures of experts and latent attention: the multi-process matrix (both versions).
MATRIX = (
    "llama",
    "gemma",
    "gemma2",
    "gemma3_text",
    "granite",
    "phi",
    "gpt_neox",
    "olmo",
    "cohere",
    "starcoder2",
    "qwen2_moe",
    "mixtral",
    "deepseek_v3",
    "glm4",
    "gemma4_text",  # per-layer inputs, sent by the first stage (transformers 5)
    "gemma3n_text",  # per-layer inputs and AltUp's stack of streams between blocks (transformers 5)
)


def registry() -> dict[str, tuple[Any, str]]:
    """``model_type -> (config class, causal-LM class name)`` for every family with a pipeline plan."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    families = {}
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        try:
            config_class = CONFIG_MAPPING[model_type]
        except (KeyError, ImportError):
            continue
        if isinstance(class_name, str) and getattr(config_class, "base_model_pp_plan", None):
            families[model_type] = (config_class, class_name)
    return families


def _has(config: Any, key: str) -> bool:
    try:
        return hasattr(config, key)
    except Exception:  # transformers 5's per-layer attributes (Gemma 4's head_dim) raise their own error on reading
        return True


def tiny_config(model_type: str, tie: bool = False, layers: int = 4, **overrides: Any) -> Any:
    config_class, _ = registry()[model_type]
    default = config_class()
    kwargs = {key: value for key, value in SIZES.items() if _has(default, key)}
    kwargs["num_hidden_layers"] = layers
    if hasattr(default, "kv_lora_rank"):  # latent attention: as many key/value heads as query heads, head_dim derived
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
        kwargs.pop("head_dim", None)
    if isinstance(getattr(default, "activation_sparsity_pattern", None), (list, tuple)):  # Gemma 3n: a value a layer
        kwargs["activation_sparsity_pattern"] = [0.0] * layers
    config = config_class(**{**kwargs, **overrides}, tie_word_embeddings=tie)
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    config._attn_implementation = "eager"
    return config


def build(model_type: str, tie: bool = False, layers: int = 4) -> torch.nn.Module:
    import transformers

    _, class_name = registry()[model_type]
    return getattr(transformers, class_name)(tiny_config(model_type, tie, layers))


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, SEQ), generator=g)
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[0, -3:] = 0
    mask[2, -5:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def unsplit(model_type: str) -> tuple[torch.nn.Module, Any]:
    """The tiny model (seed 0) and its output on :func:`batch`, after ``loss.backward()``."""
    torch.manual_seed(0)
    model = build(model_type)
    out = model(**batch(), use_cache=False)
    out.loss.backward()
    return model, out


def split_error(model_type: str, stage_counts: tuple[int, ...] = (2, 4)) -> float:
    """The largest difference between the unsplit model and its split into each number of stages (chained in one
    process as the pipeline chains them), over the logits and every parameter's gradient."""
    from lightning_pipe.models.huggingface.plan import hf_layout, hf_placeholder
    from lightning_pipe.models.huggingface.stage import hf_stage_call
    from lightning_pipe.split.partition import balance_blocks, stage_units
    from lightning_pipe.split.surgery import prune

    full, expected = unsplit(model_type)
    kwargs = batch()
    layout = hf_layout(full)
    placeholder = hf_placeholder(full)
    worst = 0.0
    for n in stage_counts:
        units = stage_units(layout, balance_blocks(len(layout.blocks), n))
        stages = [prune(copy.deepcopy(full), keep, layout.units, placeholder) for keep in units]
        for stage in stages:
            stage.zero_grad(set_to_none=True)
        outs, received = [], None
        for i, stage in enumerate(stages):
            out = hf_stage_call(stage, (), kwargs, received, i == 0, i == n - 1)
            if i < n - 1:  # the hidden states, and what travels with them (Gemma 4's per-layer inputs)
                out = out if isinstance(out, tuple) else (out,)
                received = tuple(t.detach().requires_grad_(True) for t in out)
                outs.append((out, received))
        out.loss.backward()
        for sent, got in reversed(outs):
            torch.autograd.backward(sent, [t.grad for t in got])
        worst = max(worst, (out.logits - expected.logits).abs().max().item())
        grads: dict[str, torch.Tensor] = {}
        for stage in stages:
            for name, param in stage.named_parameters():
                if param.grad is not None:
                    grads[name] = grads[name] + param.grad if name in grads else param.grad
        for name, param in full.named_parameters():
            if param.grad is not None:
                worst = max(worst, (grads[name] - param.grad).abs().max().item())
    return worst


def status(model_type: str) -> str:
    """``"exact (max difference ...)"``, or why the family is not pipelined or not generated."""
    from lightning_pipe.errors import PipelineModelError

    try:
        unsplit(model_type)
    except Exception as err:  # any failure of the generic shrinker or of the unsplit model: reported, not pipelined
        return f"not generated: the tiny model fails on one device ({type(err).__name__})"
    try:
        error = split_error(model_type)
    except PipelineModelError as err:
        return "refused: " + str(err).split(". ")[0].split(": ", 1)[-1]
    except Exception as err:  # reported in the matrix; tests/test_hf_families.py fails on it
        return f"FAILS ({type(err).__name__}: {err})"
    return f"exact ({error:.1e})" if error < 1e-5 else f"DIFFERS ({error:.1e})"


def main() -> None:
    import transformers

    print(f"transformers {transformers.__version__}")
    print("| family | class | 2 and 4 stages vs unsplit |")
    print("|---|---|---|")
    for model_type, (_, class_name) in sorted(registry().items()):
        print(f"| `{model_type}` | {class_name} | {status(model_type)} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
