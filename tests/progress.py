"""What the progress bar shows: a scenario run the same way on one device (in the pytest process) and under a
pipeline (tests/scripts/progress_bar.py), with Lightning's TQDM bar or its Rich bar.

Each bar is subclassed only to record what it displays: every ``get_metrics`` call (the values the bar renders beside
the progress), with the stage and step it was made at.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from tests.models import VOCAB, LitLM, token_dataset


class Recording:
    """Mixin: record the metrics each rendering of the bar shows."""

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)  # type: ignore[misc]
        shown = {k: (float(v) if isinstance(v, (int, float, torch.Tensor)) else v) for k, v in metrics.items()}
        self.shown.append({"stage": str(trainer.state.stage), "step": trainer.global_step, "metrics": shown})
        return metrics


class RecordingTQDM(Recording, TQDMProgressBar):
    def __init__(self) -> None:
        super().__init__(refresh_rate=1)
        self.shown: list[dict] = []


class RecordingRich(Recording, RichProgressBar):
    def __init__(self) -> None:
        super().__init__(refresh_rate=1)
        self.shown: list[dict] = []


class ProgressLM(LitLM):
    """LitLM with progress-bar logs in training (per step and per epoch) and validation."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))
        self.log("val_loss", loss, prog_bar=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(token_dataset(16, seed=1), batch_size=8)


def run(bar: str, out: Path, strategy: Any = "auto", devices: int = 1) -> dict[str, Any]:
    """Fit ProgressLM for 2 epochs of 4 steps with validation, showing ``bar`` ("tqdm" or "rich")."""
    L.seed_everything(0)
    model = ProgressLM(samples=32)
    callback = RecordingTQDM() if bar == "tqdm" else RecordingRich()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=2,
        callbacks=[callback],
        logger=CSVLogger(str(out), name=bar),
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model)
    return {
        "shown": callback.shown,
        "progress_bar_metrics": {k: float(v) for k, v in trainer.progress_bar_metrics.items()},
        "global_rank": trainer.global_rank,
    }
