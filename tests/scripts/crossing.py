"""Fit, validate and predict networks whose values cross more than one stage (tests/crossing_models.py) with
`frontend="dataflow"` under pipeline configurations.
Usage: crossing.py OUT_DIR CONFIGS_JSON  (a list of {"name", "model", "schedule"}, optionally "init_weights": a
directory under OUT_DIR). Each rank saves ``<name>.rank<r>.pt``; a config that raises leaves its traceback in
``<name>.rank<r>.failed`` and the next one runs (tests/scripts/outcomes.py)."""

import json
import sys
from pathlib import Path

import lightning.pytorch as L
import torch

import lightning_pipe
from tests.crossing_models import MICROBATCHES, MODELS, fit_validate_predict
from tests.scripts.outcomes import run_each


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    run_each(out, configs, run)


def run(out: Path, cfg: dict) -> None:
    L.seed_everything(0)
    start = out / cfg["init_weights"] if "init_weights" in cfg else None
    strategy = lightning_pipe.PipelineParallelStrategy(
        frontend="dataflow", schedule=cfg["schedule"], microbatches=MICROBATCHES, init_weights=start
    )
    result = fit_validate_predict(MODELS[cfg["model"]](), strategy, devices=2)
    torch.save(result, out / f"{cfg['name']}.rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
