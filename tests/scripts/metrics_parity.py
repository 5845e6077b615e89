"""Train LitMetricsLM under several pipeline configurations; each rank saves its per-step and final logged values.

Usage: metrics_parity.py OUT_DIR CONFIGS_JSON  (a list of {"name", "schedule", "devices", ...}).
"""

import json
import sys
from pathlib import Path

import torch

import lightning_pipe
from tests.metric_models import fit_metrics_model


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    for cfg in configs:
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
