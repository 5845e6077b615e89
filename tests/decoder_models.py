"""A Llama-style decoder written the usual way, and the LightningModule that trains it the usual way.

ModuleList of blocks with RoPE, RMSNorm and SwiGLU; a padding mask passed positionally (or by keyword) and the rope
tables ``cos``/``sin`` (no batch dimension) by keyword; the output head tied to the input embedding; right-padded
sequences of random length with ``labels=-100`` on padding and a token-mean loss returned with ``num_items``; a
shuffling DataLoader; validation, test and predict steps.
"""

from __future__ import annotations

import math

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.models import quiet_trainer

VOCAB, DIM, HEADS, SEQ = 48, 16, 2, 8


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


def rope_tables(length: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T, head_dim)`` cosine and sine tables: built in the step, passed whole to every stage."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(length).float(), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.gate, self.up = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        # A query attends to earlier real tokens, and always to itself (so a padding row is never all masked).
        allowed = causal & (mask[:, None, None, :].bool() | torch.eye(t, dtype=torch.bool, device=x.device))
        attn = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        x = x + self.out(attn.transpose(1, 2).reshape(b, t, c))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    def __init__(self, n_layers: int = 8, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(n_layers))
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, idx, mask, cos=None, sin=None):
        x = self.embed(idx) if self.embed is not None else idx
        for block in self.blocks:
            x = block(x, mask, cos, sin)
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x) if self.head is not None else x


def padded_dataset(samples: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (samples, SEQ + 1), generator=g)
    lengths = torch.randint(3, SEQ + 1, (samples,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    labels = torch.where(mask.bool(), tokens[:, 1:], torch.full_like(tokens[:, 1:], -100))
    idx = torch.where(mask.bool(), tokens[:, :-1], torch.zeros_like(tokens[:, :-1]))
    return TensorDataset(idx, mask, labels)


class LitDecoder(L.LightningModule):
    def __init__(self, keyword_mask: bool = False, tied: bool = True, n_layers: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = Decoder(n_layers=n_layers, tied=tied)
        self.step_losses: list[float] = []
        self.val_losses: list[float] = []

    def _logits(self, batch):
        idx, mask, labels = batch
        cos, sin = rope_tables(idx.shape[1], DIM // HEADS)
        if self.hparams.keyword_mask:
            logits = self.model(idx, mask=mask, cos=cos, sin=sin)
        else:
            logits = self.model(idx, mask, cos=cos, sin=sin)
        return logits, labels

    def _loss(self, batch):
        logits, labels = self._logits(batch)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        return loss, (labels != -100).sum()

    def training_step(self, batch, batch_idx):
        loss, n = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return {"loss": loss, "num_items": n}

    def validation_step(self, batch, batch_idx):
        loss, n = self._loss(batch)
        self.log("val_loss", loss, batch_size=int(n))
        return {"loss": loss, "num_items": n}

    def test_step(self, batch, batch_idx):
        loss, n = self._loss(batch)
        self.log("test_loss", loss, batch_size=int(n))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        logits, _ = self._logits(batch)
        # The logits themselves, compared with a tolerance: the pipeline reaches them through other matmul shapes
        # (microbatches), so an argmax could flip on a near-tie on another machine.
        return logits

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.step_losses.append(float(outputs["loss"]))

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if outputs is not None:
            self.val_losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self):
        # 27 samples: the 4 steps are one epoch whose last batch (3 samples) the configured microbatches do not
        # divide, so every schedule also trains a short last batch, token-weighted: 3 of 1 where the schedule takes
        # 3, else under the schedule's fallback on the same stages (DualPipeV at 2 processes needs 4 and hands it to
        # ZBVZeroBubble, 1F1B at 4 processes needs 4 and hands it to GPipe).
        return DataLoader(padded_dataset(27, seed=0), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(padded_dataset(20, seed=1), batch_size=8)

    def test_dataloader(self):
        return DataLoader(padded_dataset(12, seed=2), batch_size=8)

    def predict_dataloader(self):
        return DataLoader(padded_dataset(12, seed=3), batch_size=8)


def run_decoder(strategy=None, devices: int = 1, **model_kwargs) -> dict:
    """Fit (4 steps, validation after 2 and 4), test and predict; the single-device reference when ``strategy`` is
    None. Returns what each rank saw."""
    L.seed_everything(0)
    model = LitDecoder(**model_kwargs)
    kwargs = dict(strategy=strategy) if strategy is not None else {}
    trainer = quiet_trainer(devices=devices, max_steps=4, val_check_interval=2, **kwargs)
    trainer.fit(model)
    groups = [_group_count()]
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tested = trainer.test(model, verbose=False)
    groups.append(_group_count())
    predictions = trainer.predict(model)
    groups.append(_group_count())
    return {
        "losses": model.step_losses,
        "val_losses": model.val_losses,
        "state": state,
        "fit_metrics": fit_metrics,
        "test": tested[0] if tested else None,
        "predictions": torch.cat(predictions) if predictions and predictions[0] is not None else None,
        "pipeline_rank": getattr(trainer.strategy, "pipeline_rank", 0),
        "process_groups": groups,
        "dp_rank": getattr(trainer.strategy, "data_parallel_rank", 0),
    }


def _group_count() -> int:
    import torch.distributed as dist

    return dist.get_pg_count() if dist.is_initialized() else 0
