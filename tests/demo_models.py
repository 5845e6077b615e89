"""Lightning's demo transformer (``lightning.pytorch.demos.LightningTransformer``) fed generated tokens instead of
WikiText2: its ``prepare_data`` download is neutralised, its network built without dropout (dropout's draws follow the
pipeline's stages and microbatches, not one device's), the rest is Lightning's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos import BoringModel, DemoModel, LightningTransformer, Transformer
from lightning.pytorch.demos.boring_classes import ManualOptimBoringModel, RandomDataset
from torch.utils.data import DataLoader, TensorDataset

from tests.models import quiet_trainer

VOCAB = 50


class GeneratedTokensTransformer(LightningTransformer):
    def __init__(self) -> None:
        super().__init__(vocab_size=VOCAB)
        self.model = Transformer(vocab_size=VOCAB, dropout=0.0)
        self.losses: list[float] = []

    def prepare_data(self) -> None:
        pass  # the demo downloads WikiText2 here

    def train_dataloader(self) -> DataLoader:
        tokens = torch.randint(0, VOCAB, (16, 11), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]))  # the demo's batches of one sample

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def fit_demo_transformer(**trainer_kwargs: Any) -> dict[str, Any]:
    """Seed, fit 4 steps; the step losses and this rank's parameters."""
    L.seed_everything(0)
    model = GeneratedTokensTransformer()
    trainer = quiet_trainer(max_steps=4, **trainer_kwargs)
    trainer.fit(model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": model.losses, "state": state, "global_rank": trainer.global_rank}


class RecordingBoringModel(BoringModel):
    """Lightning's ``BoringModel`` (one ``nn.Linear``, SGD at lr 0.1 with a per-epoch StepLR, batches of one sample)
    recording each step's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


class RecordingDemoModel(DemoModel):
    """Lightning's ``DemoModel`` (``relu(l1(x.view(x.size(0), -1)))``, Adam, the batch's sum as loss) on BoringModel's
    data (it has none of its own), recording each step's loss."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.losses: list[float] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=self.batch_size)

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self(batch)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 8), batch_size=4)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fit_boring(root: Path, **trainer_kwargs: Any) -> dict[str, Any]:
    """BoringModel as Lightning's tests use it: fit 2 epochs of 4 steps with ``ModelCheckpoint`` (validation each
    epoch), resume a new instance from the last checkpoint for a third epoch, then test and predict."""
    L.seed_everything(0)
    model = RecordingBoringModel()
    limits = dict(limit_train_batches=4, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2)
    checkpoint = ModelCheckpoint(dirpath=root, save_last=True)
    trainer = quiet_trainer(max_epochs=2, callbacks=[checkpoint], enable_checkpointing=True, **limits, **trainer_kwargs)
    trainer.fit(model)
    fitted = {k: float(v) for k, v in trainer.callback_metrics.items()}
    first = {"losses": model.losses, "state": _state(model), "fitted": fitted}
    L.seed_everything(1)
    resumed = RecordingBoringModel()
    trainer = quiet_trainer(max_epochs=3, enable_checkpointing=False, **limits, **trainer_kwargs)
    trainer.fit(resumed, ckpt_path=checkpoint.last_model_path)
    L.seed_everything(2)  # the demo's loaders draw their samples when they are made
    tested = trainer.test(resumed, verbose=False)
    L.seed_everything(3)
    predictions = trainer.predict(resumed)
    return {
        "first": first,
        "losses": resumed.losses,
        "state": _state(resumed),
        "lr": resumed.lr_schedulers().get_last_lr(),
        "test": tested,
        "predictions": predictions,
        "global_rank": trainer.global_rank,
    }


def fit_demo_model(batch_size: int = 4, **trainer_kwargs: Any) -> dict[str, Any]:
    """DemoModel: fit 4 optimizer steps of batches of ``batch_size`` samples, then predict."""
    L.seed_everything(0)
    model = RecordingDemoModel(batch_size)
    trainer = quiet_trainer(max_steps=4, **trainer_kwargs)
    trainer.fit(model)
    L.seed_everything(3)
    predictions = trainer.predict(model)
    return {
        "losses": model.losses,
        "state": _state(model),
        "predictions": predictions,
        "global_rank": trainer.global_rank,
    }


class RecordingManualModel(ManualOptimBoringModel):
    """Lightning's ``ManualOptimBoringModel`` (manual optimization: ``zero_grad``, ``manual_backward``, ``step`` per
    batch) recording each step's loss. ``every > 1``: gradients accumulated over ``every`` batches, then clipped to
    ``clip``, stepped, zeroed, and the scheduler stepped (a manual loop's usual accumulation), batches of
    ``batch_size``."""

    def __init__(self, batch_size: int = 1, every: int = 1, clip: float = 0.5) -> None:
        super().__init__()
        self.batch_size, self.every, self.clip = batch_size, every, clip
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.every == 1:
            return super().training_step(batch, batch_idx)
        opt, scheduler = self.optimizers(), self.lr_schedulers()
        loss = self.step(batch)
        self.manual_backward(loss)
        if (batch_idx + 1) % self.every == 0:
            self.clip_gradients(opt, self.clip, "norm")
            opt.step()
            opt.zero_grad()
            scheduler.step()
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=self.batch_size)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def fit_manual(batch_size: int = 1, every: int = 1, **trainer_kwargs: Any) -> dict[str, Any]:
    """A manual-optimization demo: 4 optimizer steps (``every`` batches each); losses, parameters, learning rate."""
    L.seed_everything(0)
    model = RecordingManualModel(batch_size, every)
    trainer = quiet_trainer(max_steps=4, **trainer_kwargs)
    trainer.fit(model)
    return {
        "losses": model.losses,
        "state": _state(model),
        "lr": model.lr_schedulers().get_last_lr(),
        "global_step": trainer.global_step,
        "global_rank": trainer.global_rank,
    }
