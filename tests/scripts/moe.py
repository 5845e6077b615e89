"""Train transformers mixture-of-experts models with their load-balancing loss (tests/moe_models.py) under pipeline
configurations. Usage: moe.py OUT_DIR CONFIGS_JSON  (a list of {"name", "family", "schedule", "devices"}). A config
that raises leaves its traceback in ``<name>.rank<r>.failed`` and the next one runs (tests/scripts/outcomes.py)."""

import json
import sys
from pathlib import Path

import torch

import lightning_pipe
from tests.moe_models import MICROBATCHES, run_moe
from tests.scripts.outcomes import run_each


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    run_each(out, configs, run)


def run(out: Path, cfg: dict) -> None:
    strategy = lightning_pipe.PipelineParallelStrategy(schedule=cfg["schedule"], microbatches=MICROBATCHES)
    result = run_moe(cfg["family"], strategy, devices=cfg["devices"])
    torch.save(result, out / f"{cfg['name']}.rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
