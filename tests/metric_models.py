"""A LightningModule holding torchmetrics the usual ways: MetricCollection (nested, prefixes/postfixes, compute groups,
``log_dict`` of the collection or of its forward output), MeanMetric, MaxMetric, ClasswiseWrapper, and a custom metric
with ``full_state_update=True``; in training and validation. Used by the metric parity test and its script."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchmetrics import MaxMetric, MeanMetric, Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score, MulticlassRecall
from torchmetrics.wrappers import ClasswiseWrapper

from tests.models import VOCAB, LitLM, quiet_trainer, token_dataset

CLASSES = 4  # the ClasswiseWrapper logs one value per class: a few classes keep the logs short


class FullStateMean(Metric):
    """A mean whose ``forward`` goes through torchmetrics' full-state path (``full_state_update=True``)."""

    full_state_update = True

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor) -> None:
        self.total += values.double().sum()
        self.count += values.numel()

    def compute(self) -> torch.Tensor:
        return (self.total / self.count).float()


def _classification(prefix: str, postfix: str | None = None) -> MetricCollection:
    inner = MetricCollection({"f1": MulticlassF1Score(VOCAB, average="macro")}, prefix="inner_")
    return MetricCollection(
        {"acc": MulticlassAccuracy(VOCAB, average="micro"), "recall": MulticlassRecall(VOCAB), "nested": inner},
        prefix=prefix,
        postfix=postfix,
    )


class LitMetricsLM(LitLM):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.train_metrics = _classification("train_")
        self.train_mean = MeanMetric()
        self.train_max = MaxMetric()
        self.train_full = FullStateMean()
        self.train_classes = ClasswiseWrapper(
            MulticlassAccuracy(CLASSES, average=None), labels=[f"c{i}" for i in range(CLASSES)], prefix="train_acc_"
        )
        self.val_metrics = _classification("val_", postfix="_epoch")
        self.val_mean = MeanMetric()
        self.val_classes = ClasswiseWrapper(
            MulticlassAccuracy(CLASSES, average=None), labels=[f"c{i}" for i in range(CLASSES)], prefix="val_acc_"
        )
        self.records: list[dict[str, float]] = []

    def _common(self, batch):
        x, y = batch
        logits = self(x)
        flat, target = logits.reshape(-1, VOCAB), y.reshape(-1)
        token_loss = F.cross_entropy(flat, target, reduction="none")
        return flat, target, token_loss

    def training_step(self, batch, batch_idx):
        flat, target, token_loss = self._common(batch)
        loss = token_loss.mean()
        self.log_dict(self.train_metrics(flat, target))  # the collection's forward output: per-step values
        self.train_mean(token_loss.detach())
        self.log("train_mean", self.train_mean, on_step=True, on_epoch=True)
        self.train_max(flat.detach().max())
        self.log("train_max", self.train_max, on_step=True, on_epoch=True)
        self.log("train_full", self.train_full(token_loss.detach()), on_step=True)
        self.log_dict(self.train_classes(flat[:, :CLASSES], target % CLASSES))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        flat, target, token_loss = self._common(batch)
        self.val_metrics.update(flat, target)
        self.log_dict(self.val_metrics)  # the collection itself: epoch values
        self.val_mean.update(token_loss)
        self.log("val_mean", self.val_mean)
        self.log_dict(self.val_classes(flat[:, :CLASSES], target % CLASSES))
        self.log("val_loss", token_loss.mean())

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        self.records.append({k: float(v) for k, v in self.trainer.callback_metrics.items()})

    def val_dataloader(self):
        return DataLoader(token_dataset(24, seed=1), batch_size=8)


def fit_metrics_model(**trainer_kwargs):
    """Seed, build and fit LitMetricsLM for 6 steps with validation every 3 (also the single-device reference)."""
    import lightning.pytorch as L

    L.seed_everything(0)
    model = LitMetricsLM()
    trainer = quiet_trainer(max_steps=6, val_check_interval=3, **trainer_kwargs)
    trainer.fit(model)
    return trainer, model
