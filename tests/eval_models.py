"""LightningModules with validation, test and predict steps, torchmetrics and dropout/BatchNorm, for evaluation tests."""

from __future__ import annotations

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.regression import MeanSquaredError
from torchmetrics.text import Perplexity

from tests.models import VOCAB, LitLM, token_dataset


class LitEvalLM(LitLM):
    """LitLM with every evaluation hook and three metric logging patterns.

    - ``val_acc``: the metric object logged after ``forward`` (``self.val_acc(preds, y); self.log(name, self.val_acc)``)
    - ``val_ppl``: Perplexity, whose epoch value is not a mean of batch values
    - ``test_acc``: ``update`` then the object logged ``on_epoch``; ``test_mse``: computed in ``on_test_epoch_end``
    """

    def __init__(self, val_samples: int = 21, val_batch_size: int = 8, **kwargs) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self.val_acc = MulticlassAccuracy(num_classes=VOCAB, average="micro")
        self.val_ppl = Perplexity()
        self.test_acc = MulticlassAccuracy(num_classes=VOCAB, average="micro")
        self.test_mse = MeanSquaredError()
        self.val_outputs: list[float] = []

    def _loss(self, batch):
        x, y = batch
        logits = self(x)
        return logits, y, F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def validation_step(self, batch, batch_idx):
        logits, y, loss = self._loss(batch)
        self.val_acc(logits.argmax(-1), y)
        self.val_ppl(logits.float(), y)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_acc", self.val_acc)
        self.log("val_ppl", self.val_ppl)
        self.log("val_max_logit", logits.max(), reduce_fx="max")
        return loss

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if outputs is not None:
            self.val_outputs.append(float(outputs))

    def test_step(self, batch, batch_idx):
        logits, y, loss = self._loss(batch)
        self.test_acc.update(logits.argmax(-1), y)
        probs = logits.softmax(-1)
        self.test_mse.update(probs.max(-1).values, torch.ones_like(probs.max(-1).values))
        self.log("test_loss", loss)
        self.log("test_acc", self.test_acc, on_epoch=True)
        return {"loss": loss}

    def on_test_epoch_end(self) -> None:
        self.log("test_mse", self.test_mse.compute())
        self.test_mse.reset()

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        x, _ = batch
        return {"probs": self(x).softmax(-1), "first": x[:, 0]}

    def _eval_loader(self):
        return DataLoader(token_dataset(self.hparams.val_samples, seed=1), batch_size=self.hparams.val_batch_size)

    def val_dataloader(self):
        return self._eval_loader()

    def test_dataloader(self):
        return self._eval_loader()

    def predict_dataloader(self):
        return self._eval_loader()


class LitNormMLP(L.LightningModule):
    """nn.Sequential with Dropout and BatchNorm, whose running statistics are set away from their defaults."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.net = nn.Sequential(
            nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3),
        )
        for bn in (self.net[1], self.net[5]):
            bn.running_mean.copy_(torch.randn(16, generator=g))
            bn.running_var.copy_(torch.rand(16, generator=g) + 0.5)

    def forward(self, x):
        return self.net(x)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch[0])

    def _loader(self):
        g = torch.Generator().manual_seed(2)
        return DataLoader(TensorDataset(torch.randn(13, 10, generator=g), torch.randint(0, 3, (13,), generator=g)),
                          batch_size=5)

    def val_dataloader(self):
        return self._loader()

    def predict_dataloader(self):
        return self._loader()
