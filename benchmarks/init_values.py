"""What ``init_values="one_device"`` costs a rank against ``"per_unit"`` and against one device's own initialisation,
for a 0.5 B-parameter Llama built from scratch on the meta device (what ``configure_model`` under the strategy does).

The model: ``LlamaForCausalLM`` with hidden 1024, 26 layers, 16 heads / 4 key-value heads, intermediate 4096,
vocabulary 32,000, untied head (502 M parameters, fp32), transformers' own init (its ``_init_weights`` after
``nn.Linear``'s defaults, as one device runs them).

Measured, each once per ``--repeats``, in this process, one thread (``torch.set_num_threads(1)``), the median kept,
as CPU time of the process (``time.process_time``: on a shared machine wall-clock time counts the other jobs):

- ``one device``: ``LlamaForCausalLM(config)`` on the CPU from the same seed: the initialisation itself;
- for each pipeline size P and the first and last rank of it (the layers split evenly, the embedding on the first
  rank, the norm and head on the last): the rank's share built on the meta device under ``record_init``, pruned,
  then ``initialize(..., init_values=...)`` (allocation, the replay, the checks for unset tensors), for both orders.

The values of ``one_device`` are checked against the one-device model (every tensor bitwise equal), so the figure is
that of a replay that is exact. Run from the repository root (about 5 minutes on 2 busy cores, 4 GiB of memory)::

    python benchmarks/init_values.py                 # P = 2 and 4
    python benchmarks/init_values.py --quick         # a 4-layer hidden-64 Llama: the same code paths in seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from lightning_pipe.split.deferred_init import record_init
from lightning_pipe.split.initialization import initialize

RESULTS = Path(__file__).parent / "results" / "init_values.json"


def config(quick: bool):
    import transformers

    if quick:
        shape = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=256, vocab_size=512)
    else:
        shape = dict(hidden_size=1024, num_hidden_layers=26, intermediate_size=4096, vocab_size=32000)
    return transformers.LlamaConfig(**shape, num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)


def one_device(cfg) -> tuple[float, dict[str, torch.Tensor], int]:
    import transformers

    torch.manual_seed(0)
    start = time.process_time()
    model = transformers.LlamaForCausalLM(cfg)
    seconds = time.process_time() - start
    return seconds, model.state_dict(), sum(p.numel() for p in model.parameters())


def rank_share(cfg, size: int, rank: int, init_values: str) -> tuple[float, dict[str, torch.Tensor]]:
    """``initialize`` of rank ``rank``'s share of ``size`` ranks: seconds, and the tensors it holds."""
    import transformers

    torch.manual_seed(0)
    with torch.device("meta"), record_init() as recording:
        model = transformers.LlamaForCausalLM(cfg)
    recording = recording.finish(model)
    layers = cfg.num_hidden_layers
    mine = range(rank * layers // size, (rank + 1) * layers // size)
    for i in range(layers):
        if i not in mine:
            model.model.layers[i] = None
    if rank != 0:
        model.model.embed_tokens = None
    if rank != size - 1:
        model.model.norm = model.lm_head = None
    start = time.process_time()
    initialize(model, torch.device("cpu"), 0, recording=recording, init_values=init_values)
    return time.process_time() - start, model.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = config(args.quick)
    times, reference, params = [], None, 0
    for _ in range(args.repeats):
        seconds, reference, params = one_device(cfg)
        times.append(seconds)
    rows = {"one device": statistics.median(times)}
    print(f"{params / 1e6:.0f} M parameters; one device: {rows['one device']:.2f} s")
    for size in args.sizes:
        for rank in (0, size - 1):
            for init_values in ("per_unit", "one_device"):
                times = []
                for _ in range(args.repeats):
                    seconds, state = rank_share(cfg, size, rank, init_values)
                    times.append(seconds)
                    if init_values == "one_device":
                        assert all(torch.equal(v, reference[k]) for k, v in state.items()), (size, rank)
                    del state
                    gc.collect()
                key = f"P={size} rank {rank} {init_values}"
                rows[key] = statistics.median(times)
                print(f"{key}: {rows[key]:.2f} s")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"parameters": params, "quick": args.quick, "seconds": rows}, indent=1))


if __name__ == "__main__":
    main()
