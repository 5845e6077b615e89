"""A LightningModule written like a popular project template's: it receives its network as an ``__init__`` argument
and keeps it in ``save_hyperparameters()``; the network (Linear + BatchNorm1d + ReLU) reshapes its input in its
forward. Used by the fast copy tests and by ``tests/scripts/template.py``."""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

CLASSES = 4
SIDE = 4  # inputs are (batch, 1, SIDE, SIDE) images


class SimpleDenseNet(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(SIDE * SIDE, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_size, channels, width, height = x.size()
        x = x.view(batch_size, -1)  # (B, C * W * H)
        return self.model(x)


class LitTemplate(L.LightningModule):
    def __init__(self, net: nn.Module, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.net = net
        self.train_acc, self.val_acc, self.test_acc = (MulticlassAccuracy(CLASSES) for _ in range(3))
        self.val_loss = MeanMetric()
        self.records: list[dict[str, float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits.argmax(-1), y)
        self.log("train/loss", loss)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.records.append({k: float(v) for k, v in self.trainer.callback_metrics.items()})

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_loss(F.cross_entropy(logits, y))
        self.val_acc(logits.argmax(-1), y)
        self.log("val/loss", self.val_loss)
        self.log("val/acc", self.val_acc)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.test_acc(logits.argmax(-1), y)
        self.log("test/loss", F.cross_entropy(logits, y))
        self.log("test/acc", self.test_acc)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def copies(model: L.LightningModule) -> dict[str, Any]:
    """Pickle, deep-copy and ``torch.save`` ``model`` and its hyperparameters; what the copies look like."""
    pickled = pickle.loads(pickle.dumps(model))
    copied = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    hparams = pickle.loads(pickle.dumps(dict(model.hparams)))
    state = model.state_dict()
    made = (pickled, copied, saved)
    return {
        "state_keys": sorted(state),
        "copy_keys": [sorted(c.state_dict()) for c in made],
        "copies_equal": all(torch.equal(c.state_dict()[k], v) for c in made for k, v in state.items()),
        "copy_forwards": [type(c.net.__dict__.get("forward", c.net.forward)).__name__ for c in made],
        "hparams_net": type(hparams["net"]).__name__,
    }


class CopyDuringFit(Callback):
    """Copies the module the ways EMA/SWA callbacks and users do, while the strategy runs (after the first epoch)."""

    def __init__(self) -> None:
        self.found: dict[str, Any] | None = None

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.found is None:
            self.found = copies(pl_module)


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, SIDE, SIDE, generator=g)
    y = (x.flatten(1)[:, :CLASSES] * 3 + 0.5 * torch.randn(n, CLASSES, generator=g)).argmax(-1)
    return TensorDataset(x, y)


def loaders(batch_size: int = 8, n_train: int = 64) -> dict[str, DataLoader]:
    return {
        "train_dataloaders": DataLoader(dataset(n_train, 0), batch_size=batch_size),
        "val_dataloaders": DataLoader(dataset(32, 1), batch_size=batch_size),
    }


def trainer(root: Path, strategy: Any = "auto", devices: int = 1, max_epochs: int = 2) -> L.Trainer:
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", monitor="val/acc", mode="max", save_top_k=1, save_last=True)
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=max_epochs,
        callbacks=[checkpoint, CopyDuringFit()],
        default_root_dir=str(root),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )


def new_module() -> LitTemplate:
    L.seed_everything(0)
    return LitTemplate(SimpleDenseNet())


def held_out_loader(batch_size: int = 8) -> DataLoader:
    return DataLoader(dataset(32, 2), batch_size=batch_size)
