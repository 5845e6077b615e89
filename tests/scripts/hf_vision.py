"""Train tiny Hugging Face vision-language models (tests/hf_vision.py) under pipeline configurations.
Usage: hf_vision.py WORK CONFIGS_JSON (a list of {"name", "family", "schedule", "devices"}, optionally "layers" (text
layers), "freeze_vision" and "directory": start from WORK/<family> with ``init_weights`` and save the checkpoint as
``ckpt-<name>``); one launch runs them all. Each rank saves ``<name>.rank<r>.pt``; a config that
raises leaves its traceback in ``<name>.rank<r>.failed`` and the next one runs (tests/scripts/outcomes.py)."""

import json
import sys
from pathlib import Path

import lightning.pytorch as L
import torch

from lightning_pipe import PipelineParallelStrategy
from tests.hf_vision import LAYERS, LitVision
from tests.models import quiet_trainer
from tests.scripts.outcomes import run_each


def main() -> None:
    work, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    run_each(work, configs, run)


def run(work: Path, cfg: dict) -> None:
    path = work / cfg["family"] if cfg.get("directory") else None
    strategy = PipelineParallelStrategy(schedule=cfg["schedule"], init_weights=path)
    L.seed_everything(0)
    start = None if path is None else str(path)
    model = LitVision(cfg["family"], cfg.get("freeze_vision", False), start, layers=cfg.get("layers", LAYERS))
    trainer = quiet_trainer(devices=cfg["devices"], max_steps=4, val_check_interval=2, strategy=strategy)
    trainer.fit(model)
    result = {
        "losses": model.step_losses,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }
    torch.save(result, work / f"{cfg['name']}.rank{trainer.global_rank}.pt")
    if path is not None:
        trainer.save_checkpoint(work / f"ckpt-{cfg['name']}")


if __name__ == "__main__":
    main()
