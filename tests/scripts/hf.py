"""Train an unmodified Hugging Face causal LM (tests/hf_models.py) under pipeline configurations.
Usage: hf.py OUT_DIR CONFIGS_JSON  (a list of {"name", "schedule", "devices", "family", "tie", "side"}, optionally
"layers" and "max_steps"); one launch runs them all, so the family matrix pays the process start-up once."""

import json
import sys
from pathlib import Path

import torch

import lightning_pipe
from tests.hf_models import run_hf


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    for cfg in configs:
        strategy = lightning_pipe.PipelineParallelStrategy(schedule=cfg["schedule"])
        result = run_hf(
            strategy,
            devices=cfg["devices"],
            max_steps=cfg.get("max_steps", 4),
            family=cfg["family"],
            tie=cfg["tie"],
            side=cfg["side"],
            layers=cfg.get("layers", 8),
        )
        torch.save(result, out / f"{cfg['name']}.rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
