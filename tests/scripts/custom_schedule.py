"""Train LitLM under schedules given as CSV files, and a named one, in one process group; each rank saves its losses
and weights. Schedules that cannot run must be refused on every rank before any step; each rank saves the message.

Usage: custom_schedule.py OUT_DIR CONFIGS_JSON  (a list of {"name", "schedule", "microbatches", "refused", "save",
"ckpt_path", "max_epochs"}).
"""

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_pipe
from lightning_pipe.errors import PipelineConfigError
from tests.models import VOCAB, LitLM, quiet_trainer

CLIP = 0.05


class Validated(LitLM):
    """LitLM with a validation step, run after training (fit has no validation loader: training is as LitLM's)."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1)))


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
        model = Validated()
        strategy = lightning_pipe.PipelineParallelStrategy(
            schedule=cfg["schedule"], microbatches=cfg.get("microbatches", "auto")
        )
        trainer = quiet_trainer(
            strategy=strategy,
            devices=2,
            max_epochs=cfg.get("max_epochs", 1),  # an epoch of LitLM: 8 batches, 4 optimizer steps
            accumulate_grad_batches=2,
            gradient_clip_val=CLIP,
            # a checkpoint at the end of the epoch: the resumed run starts the next one
            callbacks=[ModelCheckpoint(dirpath=cfg["save"], save_last=True)] if cfg.get("save") else [],
            enable_checkpointing=bool(cfg.get("save")),
        )
        trainer.fit(model, ckpt_path=cfg.get("ckpt_path"))
        state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
        validated = trainer.validate(model, dataloaders=model.train_dataloader(), verbose=False)
        torch.save(
            {
                "losses": model.step_losses,
                "state": state,
                "pipeline_rank": strategy.pipeline_rank,
                "dp_rank": strategy.data_parallel_rank,
                "stages_per_rank": strategy.stages_per_rank,
                "schedule": strategy.schedule_name,
                "val_loss": validated[0]["val_loss"],
            },
            out / f"{cfg['name']}.rank{trainer.global_rank}.pt",
        )


if __name__ == "__main__":
    main()
