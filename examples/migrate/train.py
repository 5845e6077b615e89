"""AFTER: the training of ``before.py`` as a LightningModule, run by ``PipelineParallelStrategy``.

The model (``model.py``) is the same; the process group, the cut into stages, ``PipelineStage``, the schedule, the
per-rank ``schedule.step`` calls, the loss broadcast and the checkpoint are the strategy's. Run it with plain python
(Lightning starts the second process):

    python examples/migrate/train.py fit --config examples/migrate/config.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset

import lightning_pipe  # noqa: F401  (registers strategy="pipeline" and makes the class path importable)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import VOCAB, Decoder, text_windows  # noqa: E402


class DecoderLM(L.LightningModule):
    def __init__(self, lr: float = 3e-3, batch_size: int = 16) -> None:
        """
        Args:
            lr: AdamW learning rate.
            batch_size: Windows per batch; a multiple of the strategy's ``microbatches``.
        """
        super().__init__()
        self.save_hyperparameters()
        self.model = Decoder()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        logits = self.model(inputs)
        self.log("val_loss", F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        x, y = text_windows()
        return DataLoader(TensorDataset(x, y), batch_size=self.hparams.batch_size, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        x, y = text_windows(count=2048 + 256)
        return DataLoader(TensorDataset(x[2048:], y[2048:]), batch_size=self.hparams.batch_size, drop_last=True)


if __name__ == "__main__":
    LightningCLI(DecoderLM, save_config_kwargs={"overwrite": True})
