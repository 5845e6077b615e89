"""Train LitLM under schedules given as CSV files, and a named one, in one process group; each rank saves its losses
and weights. Schedules that cannot run must be refused on every rank before any step; each rank saves the message.

Usage: custom_schedule.py OUT_DIR CONFIGS_JSON  (a list of {"name", "schedule", "microbatches", "refused"}).
"""

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as L
import torch

import lightning_pipe
from lightning_pipe.errors import PipelineConfigError
from tests.models import LitLM

CLIP = 0.05


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    for cfg in configs:
        if cfg.get("refused"):
            # made on every rank (Lightning's launcher re-runs this script): the refusal comes before any process
            # group, any split and any step
            try:
                lightning_pipe.PipelineParallelStrategy(schedule=cfg["schedule"])
                error = None
            except PipelineConfigError as err:
                error = str(err)
            rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.save({"error": error}, out / f"error-{cfg['name']}.rank{rank}.pt")
            continue
        L.seed_everything(0)
        model = LitLM()
        strategy = lightning_pipe.PipelineParallelStrategy(
            schedule=cfg["schedule"], microbatches=cfg.get("microbatches", "auto")
        )
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=2,
            max_steps=4,
            accumulate_grad_batches=2,
            gradient_clip_val=CLIP,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model)
        state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
        torch.save(
            {
                "losses": model.step_losses,
                "state": state,
                "pipeline_rank": strategy.pipeline_rank,
                "dp_rank": strategy.data_parallel_rank,
                "stages_per_rank": strategy.stages_per_rank,
                "schedule": strategy.schedule_name,
            },
            out / f"{cfg['name']}.rank{trainer.global_rank}.pt",
        )


if __name__ == "__main__":
    main()
