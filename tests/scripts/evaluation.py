"""Validation, test and predict under several pipeline configurations in one process group; each rank saves results.

Usage: evaluation.py OUT_DIR CONFIGS_JSON  (a list of {"name", "scenario", "schedule", "devices", ...}). Each rank
saves ``<name>.rank<r>.pt``; a config that raises leaves its traceback in ``<name>.rank<r>.failed`` and the next one
runs (tests/scripts/outcomes.py).

Scenarios (the same functions build the single-device references in the pytest process, see tests/test_evaluation.py):
- "full": fit 2 epochs with validation (uneven last validation batch), CSV logger; then validate, test, predict.
- "ckpt": ModelCheckpoint(monitor="val_loss", save_top_k=2) and EarlyStopping(monitor="val_loss", patience=1).
- "norm": an nn.Sequential with Dropout and BatchNorm (non-default running statistics): validate and predict.
- "trace": the unmodified litgpt GPT cut by torch's tracer: validate and predict, with a short last batch.
- "dp": validate/test/predict with 2 data-parallel replicas of a 2-stage pipeline, ``sync_dist=True``.
"""

import json
import sys
from pathlib import Path

import torch

import lightning_pipe
from tests.eval_models import run_scenario
from tests.scripts.outcomes import run_each


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    run_each(out, configs, run)


def run(out: Path, cfg: dict) -> None:
    strategy = lightning_pipe.PipelineParallelStrategy(
        schedule=cfg["schedule"],
        pipeline_size=cfg.get("pipeline_size", "auto"),
        eval_microbatches=cfg.get("eval_microbatches", "auto"),
        frontend=cfg.get("frontend", "auto"),
    )
    result = run_scenario(cfg["scenario"], out / cfg["name"], strategy=strategy, devices=cfg["devices"])
    result.update(pipeline_rank=strategy.pipeline_rank, dp_rank=strategy.data_parallel_rank)
    torch.save(result, out / f"{cfg['name']}.rank{strategy.global_rank}.pt")


if __name__ == "__main__":
    main()
