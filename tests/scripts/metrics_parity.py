"""Train LitMetricsLM under several pipeline configurations; each rank saves its per-step and final logged values.

Usage: metrics_parity.py OUT_DIR CONFIGS_JSON  (a list of {"name", "schedule", "devices", ...}). A config with
"n_layer" runs the acceptance project instead (tests/test_project.py; joined here to share the 4-process launch).
A config that raises leaves its traceback in ``<name>.rank<r>.failed`` and the next one runs
(tests/scripts/outcomes.py).
"""

import json
import sys
from pathlib import Path

import torch

import lightning_pipe
from tests.metric_models import fit_metrics_model
from tests.project_models import run_project
from tests.scripts.outcomes import run_each


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    run_each(out, configs, run)


def run(out: Path, cfg: dict) -> None:
    if "n_layer" in cfg:
        strategy = lightning_pipe.PipelineParallelStrategy(schedule=cfg["schedule"])
        found = run_project(out / cfg["name"], cfg["n_layer"], strategy=strategy, devices=cfg["devices"])
        torch.save(found, out / f"{cfg['name']}.rank{found['global_rank']}.pt")
        return
    strategy = lightning_pipe.PipelineParallelStrategy(
        schedule=cfg["schedule"], microbatches=cfg.get("microbatches", "auto")
    )
    trainer, model = fit_metrics_model(strategy=strategy, devices=cfg["devices"])
    torch.save(
        {"records": model.records, "final": {k: float(v) for k, v in trainer.callback_metrics.items()}},
        out / f"{cfg['name']}.rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
