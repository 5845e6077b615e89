"""Generate in validation_step and predict_step (tests/generation_models.py) under pipeline configurations.
Usage: generation.py OUT_DIR CONFIGS_JSON  (a list of {"name", "schedule", "devices", "family", "sample"}, optionally
"layers", "eval_microbatches", "tuner" (a PEFT model: tests/generation_models.py) and "test" (test_step too)); one
launch runs them all, each leaving its result or its traceback (tests/scripts/outcomes.py)."""

import json
import sys
from pathlib import Path

import torch

import lightning_pipe
from tests.generation_models import run_generation
from tests.scripts.outcomes import run_each


def main() -> None:
    run_each(Path(sys.argv[1]), json.loads(sys.argv[2]), run)


def run(out: Path, cfg: dict) -> None:
    def strategy():
        return lightning_pipe.PipelineParallelStrategy(
            schedule=cfg["schedule"], eval_microbatches=cfg.get("eval_microbatches", "auto")
        )

    result = run_generation(
        strategy,
        devices=cfg["devices"],
        test=cfg.get("test", False),
        family=cfg["family"],
        sample=cfg["sample"],
        layers=cfg.get("layers", 4),
        tuner=cfg.get("tuner"),
    )
    torch.save(result, out / f"{cfg['name']}.rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
