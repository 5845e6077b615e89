"""Fine-tune tiny Hugging Face task heads (tests/hf_heads.py) under pipeline configurations, from their directories.
Usage: hf_heads.py WORK CONFIGS_JSON (a list of {"name", "task", "schedule", "side", "user_loss", "directory",
"model_plan", "lora", "bare"}); one launch runs them all (``model_plan``: the classifier's plan given to the strategy,
transformers' own removed; ``lora``: the LoRA reward-model recipe, the head in ``modules_to_save``; ``bare``: the
model's own loss returned and logged as it is, no ``num_items``). Each rank saves
per config its losses, validation losses, and the head's parameters (``<name>.rank<r>.pt``; with ``lora`` also the
tensors it started from and whether the frozen ones stayed unchanged); the run's checkpoint is saved as
``ckpt-<name>``, and the warnings the load raised. A config that raises leaves its traceback in
``<name>.rank<r>.failed`` and the next one runs (tests/scripts/outcomes.py)."""

import contextlib
import json
import sys
import warnings
from pathlib import Path

import torch

from lightning_pipe import PipelineParallelStrategy
from tests.hf_heads import USER_PLAN, fine_tune, without_plan
from tests.scripts.outcomes import run_each


def main() -> None:
    work, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    run_each(work, configs, run)


def run(work: Path, cfg: dict) -> None:
    directory = work / cfg.get("directory", cfg["task"])
    plan = USER_PLAN if cfg.get("model_plan") else None
    strategy = PipelineParallelStrategy(
        schedule=cfg["schedule"],
        init_weights=directory,
        model_plan=plan,
        init_values=cfg.get("init_values", "one_device"),
    )
    with without_plan() if plan else contextlib.nullcontext(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, trainer = fine_tune(
            work / cfg["task"],
            cfg["task"],
            strategy,
            devices=2,
            side=cfg["side"],
            user_loss=cfg["user_loss"],
            lora=cfg.get("lora", False),
            bare=cfg.get("bare", False),
        )
    result = {
        "losses": model.step_losses,
        "val_losses": model.val_losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "warnings": [str(w.message) for w in caught],
        "initial": model.initial,
        "frozen": model.frozen,
        "frozen_unchanged": model.frozen_unchanged,
    }
    torch.save(result, work / f"{cfg['name']}.rank{trainer.global_rank}.pt")
    trainer.save_checkpoint(work / f"ckpt-{cfg['name']}")


if __name__ == "__main__":
    main()
