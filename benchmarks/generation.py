"""Tokens per second of ``model.generate(...)`` in ``predict_step``: one device, and a pipeline with the batch's rows
decoding as chunks in flight (``eval_microbatches``) against one chunk at a time.

    python benchmarks/generation.py --devices 1                 # one device
    python benchmarks/generation.py --devices 2 --chunks 1 2    # 2 stages: one chunk, then 2 chunks in flight

Each configuration predicts ``--batches`` batches of ``--batch`` prompts (``--prompt`` tokens), ``--new`` new tokens
each (``min_new_tokens`` = ``max_new_tokens``: every run decodes the same number of tokens), after one warm-up batch;
the figure is generated tokens over the wall time of ``trainer.predict``. Printed as one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import json
import time

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset


class Generating(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=1024,
            hidden_size=args.width,
            intermediate_size=4 * args.width,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=args.prompt + args.new + 8,
        )
        self.model = transformers.LlamaForCausalLM(config)
        self.new = args.new

    def predict_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=self.new,
            min_new_tokens=self.new,
            do_sample=False,
            pad_token_id=0,
        )


def _trainer(args: argparse.Namespace, chunks: int | None) -> L.Trainer:
    import lightning_pipe

    kwargs = {}
    if args.devices > 1:
        kwargs["strategy"] = lightning_pipe.PipelineParallelStrategy(schedule="1F1B", eval_microbatches=chunks)
    return L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def run(args: argparse.Namespace, chunks: int | None) -> tuple[dict, int]:
    """One configuration: a warm-up batch, then the timed batches; the figures and this process's global rank."""
    torch.manual_seed(0)
    samples = (args.batches + 1) * args.batch
    data = TensorDataset(torch.randint(1, 1024, (samples, args.prompt)))
    model = Generating(args)
    warm = DataLoader(Subset(data, range(args.batch)), batch_size=args.batch)
    _trainer(args, chunks).predict(model, warm)
    timed = DataLoader(Subset(data, range(args.batch, samples)), batch_size=args.batch)
    trainer = _trainer(args, chunks)
    start = time.perf_counter()
    trainer.predict(model, timed)
    seconds = time.perf_counter() - start
    tokens = args.batches * args.batch * args.new
    result = {
        "devices": args.devices,
        "chunks": chunks if args.devices > 1 else None,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "threads": torch.get_num_threads(),
    }
    return result, trainer.global_rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    for chunks in args.chunks if args.devices > 1 else [None]:
        result, rank = run(args, chunks)
        if rank == 0:
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
