"""A GPT-style byte-level language model, pipelined over 2 CPU processes, trained on the Python standard library.

Every machine with Python has the corpus: the ``.py`` files of the standard library (``sysconfig``'s ``stdlib``
path), read as bytes, so nothing is downloaded. Run from the repository root:

    python examples/gpt/train.py fit --config examples/gpt/config.yaml
"""

from __future__ import annotations

import math
import os
import sysconfig
import zlib
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.text import Perplexity

import lightning_pipe  # noqa: F401  (registers strategy="pipeline" and makes the class path importable)

VOCAB = 256  # bytes
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


# ---------------------------------------------------------------------------------------------------------- model
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Embedding, a ``ModuleList`` of blocks, final norm, head.

    The only change pipelining needs is in ``forward``: on each stage the units that other stages own are ``None``,
    and ``forward`` skips them (the first stage embeds, the last one normalises and projects).
    """

    def __init__(self, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        # Not tied to `wte`: tied weights would have to live on the first and the last stage at once.
        self.head = nn.Linear(n_embd, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # The `None` checks are optional (without them `frontend="auto"` picks the dataflow frontend, which runs this
        # forward unchanged); with them it picks the modules frontend, which skips the units other stages hold.
        if self.wte is not None:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        else:
            x = idx  # a later stage receives the hidden states
        for block in self.blocks:
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.head is not None:
            x = self.head(x)  # (B, T, VOCAB)
        return x


class GPTLightning(L.LightningModule):
    """A byte-level GPT; ``training_step``/``validation_step`` are exactly what a single-device run would use."""

    def __init__(
        self,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
    ) -> None:
        """
        Args:
            block_size: Context length in bytes.
            n_layer: Transformer blocks (the pipeline shares them out; at least one per stage).
            n_head: Attention heads per block.
            n_embd: Hidden size.
            dropout: Dropout probability in attention.
            lr: Peak AdamW learning rate (linear warmup, then cosine decay to 10% over ``max_steps``).
            weight_decay: AdamW weight decay of matrices (not of norms, biases or embeddings).
            warmup_steps: Linear warmup steps.
        """
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(block_size, n_layer, n_head, n_embd, dropout)
        self.train_ppl = Perplexity()
        self.val_ppl = Perplexity()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.train_ppl(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_ppl", self.train_ppl, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.val_ppl(logits, y)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_ppl", self.val_ppl, prog_bar=True)
        return loss

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        # Embeddings are 2-D but are looked up, not multiplied: no decay for them either.
        embeddings = {id(p) for m in self.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        no_decay += [p for p in decay if id(p) in embeddings]
        decay = [p for p in decay if id(p) not in embeddings]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
            betas=(0.9, 0.95),
        )
        total = max(int(self.trainer.max_steps), 1) if self.trainer.max_steps > 0 else 10_000
        warmup = self.hparams.warmup_steps

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min((step - warmup) / max(total - warmup, 1), 1.0)
            return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ----------------------------------------------------------------------------------------------------------- data
def stdlib_sources(root: str | None = None) -> list[Path]:
    """The standard library's ``.py`` files in a fixed order, without test suites and installed packages."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for directory, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        found += [Path(directory) / f for f in sorted(files) if f.endswith(".py")]
    return found


def read_corpus(files: list[Path], root: Path, val_every: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of the training files and of the validation files (one file in ``val_every``, chosen by path hash)."""
    train, val = bytearray(), bytearray()
    for path in files:
        rel = path.relative_to(root).as_posix()
        # crc32 of the relative path: the same files go to validation on every machine and in every process.
        (val if zlib.crc32(rel.encode()) % val_every == 0 else train).extend(path.read_bytes() + b"\n\n")
    as_tensor = lambda b: torch.frombuffer(b, dtype=torch.uint8).long()  # noqa: E731
    return as_tensor(train), as_tensor(val)


class Windows(Dataset):
    """Consecutive, non-overlapping windows of ``block_size + 1`` bytes: (input, next-byte target)."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


class StdlibBytes(L.LightningDataModule):
    def __init__(self, block_size: int = 128, batch_size: int = 16, val_every: int = 20, stdlib: str | None = None):
        """
        Args:
            block_size: Context length in bytes (must match the model's).
            batch_size: Windows per batch; a multiple of the strategy's ``microbatches``.
            val_every: One source file in ``val_every`` is held out for validation.
            stdlib: Directory to read ``.py`` files from. Default: this interpreter's standard library.
        """
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        root = Path(self.hparams.stdlib or sysconfig.get_paths()["stdlib"])
        train, val = read_corpus(stdlib_sources(str(root)), root, self.hparams.val_every)
        self.train_set = Windows(train, self.hparams.block_size)
        self.val_set = Windows(val, self.hparams.block_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


def main() -> None:
    LightningCLI(GPTLightning, StdlibBytes, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
