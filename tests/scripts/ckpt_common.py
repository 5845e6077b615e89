"""Shared pieces of the checkpoint scripts: a LitLM with Adam and a per-step LR scheduler, a Trainer factory, and
what each rank records (losses, its parameters, its Adam moments by parameter name)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_pipe
from lightning_pipe.checkpoint import io as ckpt_io
from tests.models import LitLM

#: 24 samples in batches of 8: an epoch is 3 steps, so a checkpoint after step 3 sits on an epoch boundary.
SAMPLES = 24


class LitLMScheduled(LitLM):
    """LitLM with Adam and a per-step LR decay, so a resume must restore both optimizer moments and scheduler."""

    def __init__(self, n_layers: int = 8) -> None:
        super().__init__(n_layers=n_layers, lr=0.01, samples=SAMPLES, optimizer="adam")

    def predict_step(self, batch, batch_idx):
        (x,) = batch
        return self(x)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def strategy(schedule: str = "1F1B", **kwargs: Any) -> lightning_pipe.PipelineParallelStrategy:
    from datetime import timedelta

    # A short timeout: a test that deadlocks fails in a minute instead of the default half hour.
    return lightning_pipe.PipelineParallelStrategy(schedule=schedule, timeout=timedelta(seconds=60), **kwargs)


def trainer(
    strat: Any, devices: int = 2, max_steps: int = 6, callbacks: list | None = None, **kwargs: Any
) -> L.Trainer:
    return L.Trainer(
        strategy=strat,
        accelerator="cpu",
        devices=devices,
        max_steps=max_steps,
        logger=False,
        # Lightning adds a default ModelCheckpoint (writing into the cwd) unless checkpointing is off.
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks or []),
        callbacks=callbacks or [],
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def snapshot(trainer: L.Trainer, module: L.LightningModule) -> dict[str, Any]:
    """This rank's parameters and optimizer state by parameter name, and its scheduler state."""
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    optim = {}
    if trainer.optimizers:
        flat = ckpt_io.optimizer_state(module, trainer.optimizers[0])
        optim = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
    schedulers = [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs]
    return {"state": state, "optim": optim, "schedulers": schedulers, "global_step": trainer.global_step}


class Snapshot(L.Callback):
    """Record the state right after a resume restored it, before the first new step."""

    def __init__(self) -> None:
        self.taken: dict[str, Any] | None = None

    def on_train_start(self, trainer, pl_module):
        self.taken = snapshot(trainer, pl_module)


def save(obj: Any, out: Path, name: str, rank: int) -> None:
    torch.save(obj, out / f"{name}.rank{rank}.pt")
