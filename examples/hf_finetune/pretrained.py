"""Write a small Llama as a Hugging Face model directory, standing in for a downloaded pretrained model.

A real run would start from a directory that ``huggingface-cli download`` (or ``snapshot_download``) fetched, such as
``meta-llama/Llama-3.2-1B``: ``config.json``, ``generation_config.json`` and the weights in safetensors shards with
their index. This script writes the same files with ``save_pretrained`` (a byte-level vocabulary, random weights,
several shards), so the example runs anywhere without a download:

    python examples/hf_finetune/pretrained.py pretrained/tiny-llama
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="directory to write")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--max-shard-size", default="1MB", help="several shards, as a large model has")
    args = parser.parse_args()
    config = transformers.LlamaConfig(
        vocab_size=256,  # bytes
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(args.out, max_shard_size=args.max_shard_size)
    files = sorted(p.name for p in args.out.iterdir())
    print(f"wrote {args.out}: {', '.join(files)}")


if __name__ == "__main__":
    main()
