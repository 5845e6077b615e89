"""The issue's acceptance project, written as a user writes it for one device: a char-level GPT whose forward computes
positions from its input (``b, t = idx.size()``) and never checks for ``None``; a training set whose size leaves a short
last batch, shuffled; a ``MetricCollection`` cloned with prefixes and ``MeanMetric``; AdamW with a per-step
``LambdaLR``, ``LearningRateMonitor``, ``ModelCheckpoint(monitor=..., save_top_k=1, save_last=True)``, clipping,
accumulation 2; then ``trainer.test`` from the best checkpoint and ``trainer.predict``. Nothing in it knows of the
pipeline: the parity script and the one-device reference build the same Trainer, only ``strategy``/``devices`` differ.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from tests.gpt2 import Block  # attention + MLP blocks, written the usual way

TEXT = (
    "to be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles "
)
CHARS = sorted(set(TEXT))
BLOCK = 8  # context length
TRAIN, VAL, TEST, PREDICT = 41, 20, 21, 11  # 41 = 16 + 16 + 9: the last training batch is short
BATCH = 16


class CharDataset(Dataset):
    """Windows of ``BLOCK + 1`` characters of ``TEXT`` starting at ``offset``: (input, next characters)."""

    def __init__(self, length: int, offset: int = 0) -> None:
        self.data = torch.tensor([CHARS.index(c) for c in TEXT], dtype=torch.long)
        self.length, self.offset = length, offset

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (self.offset + 3 * i) % (len(self.data) - BLOCK - 1)
        chunk = self.data[start : start + BLOCK + 1]
        return chunk[:-1], chunk[1:]


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int = 4, n_head: int = 2, n_embd: int = 32) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                h=nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer)),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)


class CharGPT(L.LightningModule):
    def __init__(self, lr: float = 3e-3, warmup: int = 3, n_layer: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(len(CHARS), BLOCK, n_layer=n_layer)
        metrics = MetricCollection({"acc": MulticlassAccuracy(len(CHARS), average="micro")})
        self.train_metrics = metrics.clone(prefix="train/")
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")
        self.train_loss, self.val_loss, self.test_loss = MeanMetric(), MeanMetric(), MeanMetric()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _shared(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x).view(-1, len(CHARS))
        target = y.view(-1)
        return F.cross_entropy(logits, target), logits, target

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, logits, target = self._shared(batch)
        self.train_loss(loss)
        self.train_metrics(logits, target)
        self.log("train/loss", self.train_loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log_dict(self.train_metrics, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, logits, target = self._shared(batch)
        self.val_loss(loss)
        self.val_metrics(logits, target)
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log_dict(self.val_metrics)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        loss, logits, target = self._shared(batch)
        self.test_loss(loss)
        self.test_metrics(logits, target)
        self.log("test/loss", self.test_loss)
        self.log_dict(self.test_metrics)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self(x)[:, -1].softmax(-1)  # next-character probabilities

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        warmup = self.hparams.warmup

        def schedule(step: int) -> float:  # linear warmup, then cosine decay over the run
            if step < warmup:
                return (step + 1) / warmup
            total = max(self.trainer.estimated_stepping_batches, warmup + 1)
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(CharDataset(TRAIN), batch_size=BATCH, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(CharDataset(VAL, offset=1), batch_size=BATCH)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(CharDataset(TEST, offset=2), batch_size=BATCH)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(CharDataset(PREDICT, offset=3), batch_size=BATCH)


class HistoryLogger(Logger):
    """Every ``log_metrics`` call as (step, metrics): the logged history a CSV or TensorBoard logger would write."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "history"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.history.append((step, {k: float(v) for k, v in metrics.items()}))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def run_project(root: Path, n_layer: int = 4, **trainer_kwargs: Any) -> dict[str, Any]:
    """Seed, fit for 3 epochs, test the best checkpoint, predict; what a user would look at. ``trainer_kwargs``:
    ``devices`` and ``strategy``, nothing else differs between one device and the pipeline."""
    L.seed_everything(0)
    model = CharGPT(n_layer=n_layer)
    logger = HistoryLogger()
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", monitor="val/loss", save_top_k=1, save_last=True)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=3,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[checkpoint, LearningRateMonitor(logging_interval="step")],
        gradient_clip_val=1.0,
        accumulate_grad_batches=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(model)
    fitted = {k: float(v) for k, v in trainer.callback_metrics.items()}
    best = float(checkpoint.best_model_score)
    tested = trainer.test(model, ckpt_path="best", verbose=False)[0]
    predicted = trainer.predict(model)
    # Rank 0 writes the predictions (the DDP idiom); under the pipeline the other ranks return Nones.
    predicted = torch.cat(predicted) if trainer.is_global_zero else None
    return {
        "history": logger.history,
        "fitted": fitted,
        "best_score": best,
        "best_name": Path(checkpoint.best_model_path).name,
        "test": tested,
        "predictions": predicted,
        "global_rank": trainer.global_rank,
    }
