"""Small LightningModules shared by the tests and their subprocess scripts."""

from __future__ import annotations

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 32
SEQ = 6


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """The seed article's pattern: embedding, a ModuleList of blocks, norm, head; forward skips missing units."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16, n_layers: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) if self.embed is not None else idx
        for layer in self.layers:
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.head is not None:
            h = self.head(h)
        return h


class LitLM(L.LightningModule):
    def __init__(
        self,
        n_layers: int = 8,
        lr: float = 0.05,
        batch_size: int = 8,
        samples: int = 64,
        optimizer: str = "sgd",
        meta_init: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.step_losses: list[float] = []
        if not meta_init:
            self.model = TinyLM(n_layers=n_layers)

    def configure_model(self) -> None:
        if self.hparams.meta_init and not hasattr(self, "model"):
            self.model = TinyLM(n_layers=self.hparams.n_layers)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.step_losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        if self.hparams.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(token_dataset(self.hparams.samples), batch_size=self.hparams.batch_size)


def quiet_trainer(**kwargs) -> L.Trainer:
    """A CPU Trainer with no logger, checkpoints, progress bar, model summary or sanity check (``kwargs`` win): the
    runs that parity tests compare, and nothing that writes files or output."""
    defaults = dict(
        accelerator="cpu",
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**defaults, **kwargs})


def token_dataset(samples: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


class LitMLP(L.LightningModule):
    """A plain nn.Sequential network (the seeds' AlexNet/ResNet style), no forward changes."""

    def __init__(self, lr: float = 0.1, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3)
        )
        self.step_losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.step_losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(48, 10, generator=g)
        y = torch.randint(0, 3, (48,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=self.hparams.batch_size)


class _TokenTask(L.LightningModule):
    """Next-token training on `token_dataset` with SGD, recording each step's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.step_losses: list[float] = []

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.step_losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(token_dataset(64), batch_size=8)


class FlatLM(_TokenTask):
    """Layers defined directly on the LightningModule (the LightningModule itself is the pipelined network)."""

    def __init__(self, n_layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList(Block(16) for _ in range(n_layers))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, idx):
        h = self.embed(idx) if self.embed is not None else idx
        for layer in self.layers:
            h = layer(h)
        return self.head(h) if self.head is not None else h

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))
        self.log("train_loss", loss)
        return loss


class LitGPTModule(_TokenTask):
    """The public litgpt GPT, unmodified (its forward cannot skip missing units): needs frontend="trace"."""

    def __init__(self, n_layers: int = 4) -> None:
        super().__init__()
        from litgpt.config import Config
        from litgpt.model import GPT

        config = Config(
            block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=n_layers, n_head=2, n_embd=16, bias=True
        )
        self.model = GPT(config)
        self.example_input_array = torch.zeros(8, SEQ, dtype=torch.long)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        self.log("train_loss", loss)
        return loss


class LitLMWithMetric(LitLM):
    """Training accuracy as a torchmetrics object, called per step and logged per step and per epoch."""

    def __init__(self) -> None:
        super().__init__()
        from torchmetrics.classification import MulticlassAccuracy

        self.train_acc = MulticlassAccuracy(num_classes=VOCAB, average="micro")
        self.step_acc: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        self.train_acc(logits.reshape(-1, VOCAB), y.reshape(-1))
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        self.step_acc.append(float(self.trainer.callback_metrics["train_acc_step"]))


class LitTiedLM(LitLM):
    """TinyLM whose head shares the embedding's weight, with an example input for the tracer."""

    def __init__(self) -> None:
        super().__init__(n_layers=4)
        self.model.head.weight = self.model.embed.weight
        self.example_input_array = torch.zeros(8, SEQ, dtype=torch.long)


def build_model(name: str) -> L.LightningModule:
    return {
        "lm": lambda: LitLM(),
        "lm-meta": lambda: LitLM(meta_init=True),
        "lm5": lambda: LitLM(n_layers=5),
        "lm-short-last": lambda: LitLM(samples=60),  # 7 batches of 8, then one of 4
        "lm-odd-last": lambda: LitLM(samples=61),  # 7 batches of 8, then one of 5
        "lm-metric": lambda: LitLMWithMetric(),
        "mlp": lambda: LitMLP(),
        "flat": lambda: FlatLM(),
        "litgpt": lambda: LitGPTModule(),
        "tied": lambda: LitTiedLM(),
    }[name]()
