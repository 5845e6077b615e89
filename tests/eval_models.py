"""LightningModules with evaluation hooks, torchmetrics, dropout and BatchNorm, and the evaluation test scenarios."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.regression import MeanSquaredError
from torchmetrics.text import Perplexity

from tests.models import VOCAB, LitGPTModule, LitLM, token_dataset


class LitEvalLM(LitLM):
    """LitLM with every evaluation hook and three metric logging patterns.

    - ``val_acc``: the metric object logged after ``forward`` (``self.val_acc(preds, y); self.log(name, self.val_acc)``)
    - ``val_ppl``: Perplexity, whose epoch value is not a mean of batch values
    - ``test_acc``: ``update`` then the object logged ``on_epoch``; ``test_mse``: computed in ``on_test_epoch_end``
    """

    def __init__(self, val_samples: int = 21, val_batch_size: int = 8, sync_dist: bool = False, **kwargs) -> None:
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
        self.log("val_loss", loss, prog_bar=True, sync_dist=self.hparams.sync_dist)
        self.log("val_acc", self.val_acc, sync_dist=self.hparams.sync_dist)
        self.log("val_ppl", self.val_ppl, sync_dist=self.hparams.sync_dist)
        self.log("val_max_logit", logits.max(), reduce_fx="max", sync_dist=self.hparams.sync_dist)
        return loss

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if outputs is not None:
            self.val_outputs.append(float(outputs))

    def test_step(self, batch, batch_idx):
        logits, y, loss = self._loss(batch)
        self.test_acc.update(logits.argmax(-1), y)
        probs = logits.softmax(-1)
        self.test_mse.update(probs.max(-1).values, torch.ones_like(probs.max(-1).values))
        self.log("test_loss", loss, sync_dist=self.hparams.sync_dist)
        self.log("test_acc", self.test_acc, on_epoch=True, sync_dist=self.hparams.sync_dist)
        return {"loss": loss}

    def on_test_epoch_end(self) -> None:
        self.log("test_mse", self.test_mse.compute(), sync_dist=self.hparams.sync_dist)
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
            nn.Linear(10, 16),
            nn.BatchNorm1d(16),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(16, 16),
            nn.BatchNorm1d(16),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(16, 16),
            nn.ReLU(),
            nn.Linear(16, 3),
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
        return DataLoader(
            TensorDataset(torch.randn(13, 10, generator=g), torch.randint(0, 3, (13,), generator=g)), batch_size=5
        )

    def val_dataloader(self):
        return self._loader()

    def predict_dataloader(self):
        return self._loader()


class LitGPTEval(LitGPTModule):
    """The unmodified litgpt GPT (frontend="trace", whose graphs fix the microbatch size) with evaluation hooks."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.model(x).reshape(-1, VOCAB), y.reshape(-1)))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self.model(batch[0])

    def val_dataloader(self):
        return DataLoader(token_dataset(13, seed=1), batch_size=8)

    def predict_dataloader(self):
        return self.val_dataloader()


class EpochRecorder(L.Callback):
    """Every rank's view of the logged metrics after each validation run (sanity check included)."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []
        self.sanity: list[dict[str, float]] = []

    def on_validation_end(self, trainer, pl_module) -> None:
        seen = {k: float(v) for k, v in trainer.callback_metrics.items()}
        (self.sanity if trainer.sanity_checking else self.epochs).append(seen)


def _trainer(root: Path, strategy: Any, devices: int, **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": devices,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(root),
    }
    if strategy is not None:
        options["strategy"] = strategy
    options.update(kwargs)
    return L.Trainer(**options)


def _floats(results: list[dict]) -> list[dict[str, float]]:
    return [{k: float(v) for k, v in r.items()} for r in results]


def _cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def run_scenario(scenario: str, root: Path, strategy: Any = None, devices: int = 1) -> dict[str, Any]:
    """Run one evaluation scenario (single device when ``strategy`` is None) and return what the tests compare."""
    L.seed_everything(0)
    root.mkdir(parents=True, exist_ok=True)
    recorder = EpochRecorder()
    if scenario == "full":
        model = LitEvalLM()
        logger = CSVLogger(str(root), name="csv", version=0)
        trainer = _trainer(
            root,
            strategy,
            devices,
            max_epochs=2,
            limit_train_batches=3,
            logger=logger,
            log_every_n_steps=1,
            callbacks=[recorder],
        )
        trainer.fit(model)
        out = {
            "epochs": recorder.epochs,
            "sanity": recorder.sanity,
            "losses": model.step_losses,
            "state": {k: v.detach().float().clone() for k, v in model.state_dict().items()},
            "val_outputs": model.val_outputs,
        }
        out["validate"] = _floats(trainer.validate(model, verbose=False))
        out["test"] = _floats(trainer.test(model, verbose=False))
        out["predict"] = _cpu(trainer.predict(model))
        out["csv"] = str(root / "csv" / "version_0" / "metrics.csv")
        return out
    if scenario == "ckpt":
        model = LitEvalLM(lr=0.02)
        ckpt = ModelCheckpoint(
            dirpath=str(root / "ckpt"), monitor="val_loss", save_top_k=2, filename="{epoch}-{val_loss:.4f}"
        )
        stop = EarlyStopping(monitor="val_loss", patience=1)
        trainer = _trainer(
            root,
            strategy,
            devices,
            max_epochs=8,
            limit_train_batches=4,
            enable_checkpointing=True,
            callbacks=[ckpt, stop, recorder],
        )
        trainer.fit(model)
        return {
            "epochs": recorder.epochs,
            "best_k": sorted(Path(p).name for p in ckpt.best_k_models),
            "best": Path(ckpt.best_model_path).name,
            "stopped_epoch": stop.stopped_epoch,
            "current_epoch": trainer.current_epoch,
        }
    if scenario == "norm":
        model = LitNormMLP()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        trainer = _trainer(root, strategy, devices, callbacks=[recorder])
        out = {"validate": _floats(trainer.validate(model, verbose=False)), "predict": _cpu(trainer.predict(model))}
        after = model.state_dict()
        out["state_unchanged"] = all(torch.equal(before[k], after[k]) for k in after)
        return out
    if scenario == "trace":
        model = LitGPTEval()
        trainer = _trainer(root, strategy, devices)
        return {"validate": _floats(trainer.validate(model, verbose=False)), "predict": _cpu(trainer.predict(model))}
    if scenario == "dp":
        model = LitEvalLM(val_samples=24, val_batch_size=4, sync_dist=True)
        trainer = _trainer(root, strategy, devices, callbacks=[recorder])
        out = {"validate": _floats(trainer.validate(model, verbose=False))}
        out["test"] = _floats(trainer.test(model, verbose=False))
        out["predict"] = _cpu(trainer.predict(model))
        return out
    raise ValueError(f"Unknown scenario {scenario!r}.")
