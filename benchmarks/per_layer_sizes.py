"""Memory per stage and bytes sent per hop for the families whose layers read per-layer inputs (Gemma 3n, Gemma 4),
at their default (released-size) configs, on the meta device: no weights are allocated and nothing is trained.

Each model is built on the meta device in bf16 and cut by the strategy's own code (the even split, moved by
``keep_together`` so that layers reusing keys and values stay with their source); every stage call runs the model's
forward on meta tensors, so the bytes a stage sends are the sizes of the tensors it returns, as the pipeline sends
them. Usage: ``python -m benchmarks.per_layer_sizes [FAMILY ...]`` (transformers 5); prints docs/huggingface.md's
tables.
"""

from __future__ import annotations

import copy
import sys

import torch

from lightning_pipe.models.huggingface.plan import hf_layout, hf_placeholder
from lightning_pipe.models.huggingface.stage import hf_stage_call
from lightning_pipe.split.partition import balance_blocks, keep_together, stage_units
from lightning_pipe.split.surgery import prune

FAMILIES = {"gemma3n_text": "Gemma3nForCausalLM", "gemma4_text": "Gemma4ForCausalLM"}
TOKENS = 8
#: Masks given as built (no mask: shapes only), so that transformers does not read mask values, which meta tensors lack
NO_MASKS = {"full_attention": None, "sliding_attention": None}


def _model(family: str) -> torch.nn.Module:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[family](tie_word_embeddings=True)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        return getattr(transformers, FAMILIES[family])(config).to(torch.bfloat16)


def _bytes(tensors) -> int:
    tensors = tensors if isinstance(tensors, tuple) else (tensors,)
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(family: str, num_stages: int) -> dict:
    """Blocks, parameter GB and bytes sent forward per token at each boundary for ``num_stages`` stages."""
    model = _model(family)
    layout, placeholder = hf_layout(model), hf_placeholder(model)
    counts = keep_together(balance_blocks(len(layout.blocks), num_stages), layout.together)
    stages = [prune(copy.deepcopy(model), keep, layout.units, placeholder) for keep in stage_units(layout, counts)]
    ids = torch.zeros(1, TOKENS, dtype=torch.long, device="meta")
    received, sent = None, []
    for i, stage in enumerate(stages[:-1]):
        out = hf_stage_call(stage, (), {"input_ids": ids, "attention_mask": NO_MASKS}, received, i == 0, False)
        sent.append([_bytes(t) // TOKENS for t in out])
        received = out
    params = [sum(p.numel() * p.element_size() for p in stage.parameters()) / 1e9 for stage in stages]
    return {"counts": counts, "params_gb": params, "sent_per_token": sent}


def main() -> None:
    for family in sys.argv[1:] or list(FAMILIES):
        for num_stages in (2, 4):
            result = measure(family, num_stages)
            params = ", ".join(f"{gb:.2f}" for gb in result["params_gb"])
            sent = "; ".join(f"{sum(hop):,} ({' + '.join(f'{b:,}' for b in hop)})" for hop in result["sent_per_token"])
            print(f"| {family} | {num_stages} {tuple(result['counts'])} | {params} | {sent} |", flush=True)


if __name__ == "__main__":
    main()
