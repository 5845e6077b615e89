"""A LightningModule whose resumed runs can differ from uninterrupted ones in every way the issue lists: dropout in
every block (the compute stream of every stage), a shuffling training loader (the data stream), validation between
checkpoints (a loader that draws its base seed), an LR scheduler that steps every batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from tests.models import VOCAB, LitLM, token_dataset


class ShuffledDropoutLM(LitLM):
    def __init__(self, samples: int = 40, batch_size: int = 4, num_workers: int = 0, **kwargs) -> None:
        super().__init__(batch_size=batch_size, samples=samples, **kwargs)
        self.num_workers = num_workers
        self.model.layers = nn.ModuleList(nn.Sequential(block, nn.Dropout(0.2)) for block in self.model.layers)

    def train_dataloader(self):
        data = token_dataset(self.hparams.samples)
        return DataLoader(data, batch_size=self.hparams.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self):
        return DataLoader(token_dataset(8, seed=1), batch_size=4)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1)))

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
