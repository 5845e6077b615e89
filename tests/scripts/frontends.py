"""Several ways of cutting a network, each trained under the pipeline; each rank saves losses and weights.

Usage: frontends.py OUT_DIR CONFIGS_JSON (a list of {"name", "model", "devices", strategy kwargs...}). A config that
raises leaves its traceback in ``<name>.rank<r>.failed`` and the next one runs (tests/scripts/outcomes.py).
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as L
import torch

import lightning_pipe
from tests.models import build_model
from tests.scripts.outcomes import run_each

STRATEGY_KEYS = (
    "schedule",
    "pipeline_size",
    "microbatches",
    "microbatch_size",
    "stages_per_rank",
    "module",
    "frontend",
    "blocks",
    "split_points",
    "balance",
)


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    run_each(out, configs, run)


def run(out: Path, cfg: dict) -> None:
    L.seed_everything(0)
    model = build_model(cfg["model"])
    strategy = lightning_pipe.PipelineParallelStrategy(**{k: cfg[k] for k in STRATEGY_KEYS if k in cfg})
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=cfg["devices"],
        num_nodes=cfg.get("num_nodes", 1),
        precision=cfg.get("precision", "32-true"),
        max_steps=cfg.get("max_steps", 4),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    torch.save(
        {
            "losses": model.step_losses,
            "state": {k: v.detach().float().clone() for k, v in model.state_dict().items()},
            "logged": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "step_acc": getattr(model, "step_acc", None),
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "pipeline_rank": strategy.pipeline_rank,
            "dp_rank": strategy.data_parallel_rank,
        },
        out / f"{cfg['name']}.rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
