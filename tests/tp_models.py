"""A Llama-style decoder ready for tensor parallelism, and the LightningModule that trains it with the user's own
``parallelize_module`` plan in ``configure_model``.

The decoder of tests/decoder_models.py (RoPE, RMSNorm, SwiGLU, padding mask, tied head, ``num_items``) with separate
q/k/v projections and each block's head count taken from its projections (``view(b, t, -1, head_dim)``), as
torchtitan's and transformers' attention do: a tensor-parallel rank computes its own heads. Plans:

- ``"plain"``: q/k/v/gate/up column-parallel, out/down row-parallel, the vocabulary split over the ranks in the tied
  embedding (row-parallel) and the head (column-parallel, its output gathered); stage boundaries are whole tensors;
- ``"sequence"``: sequence parallelism (norms and boundaries split over the sequence, ``Shard(1)``) and a head whose
  output stays split over the vocabulary (a DTensor, for ``loss_parallel=True``); boundaries local tensors;
- ``"dtensor"``: as ``"sequence"`` with DTensors crossing the stage boundaries.
"""

from __future__ import annotations

import math

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from tests.decoder_models import DIM, HEADS, VOCAB, RMSNorm, padded_dataset, rope_tables, rotate

PLANS = ("plain", "sequence", "dtensor")
#: plans that make errors: the head split but not its tied embedding; a mesh of the user's own; none at all
WRONG_PLANS = ("head-only", "foreign", "none")


class TPBlock(nn.Module):
    def __init__(self, dim: int, heads: int, qk_norm: bool = False) -> None:
        super().__init__()
        self.head_dim = dim // heads
        # Per-head query norm (Qwen3's q_norm): whole on every rank, applied to each rank's own heads.
        self.q_norm = RMSNorm(self.head_dim) if qk_norm else None
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)
        self.gate, self.up = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        q, k, v = self.wq(h), self.wk(h), self.wv(h)
        b, t = q.shape[:2]  # the whole sequence even when x holds a part of it (sequence parallelism)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))  # (B, local heads, T, D)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        allowed = causal & (mask[:, None, None, :].bool() | torch.eye(t, dtype=torch.bool, device=q.device))
        attn = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        x = x + self.wo(attn.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TPDecoder(nn.Module):
    def __init__(self, n_layers: int = 8, tied: bool = True, qk_norm: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(TPBlock(DIM, HEADS, qk_norm) for _ in range(n_layers))
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


def parallelize(model: TPDecoder, tp_mesh, plan: str = "plain") -> None:
    """The user's plan, for the units this rank holds (the others are absent: skipped). ``"head-only"``: the plain
    plan without the embedding (its tied head split, itself not)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if plan in ("plain", "head-only"):
        layers = {n: ColwiseParallel() for n in ("wq", "wk", "wv", "gate", "up")}
        layers.update(wo=RowwiseParallel(), down=RowwiseParallel())
        embed, norm = RowwiseParallel(input_layouts=Replicate()), None
        head = ColwiseParallel(output_layouts=Replicate())
    else:
        local = plan == "sequence"  # "dtensor": DTensors leave the blocks and cross the stage boundaries
        layers = {n: ColwiseParallel(input_layouts=Shard(1)) for n in ("wq", "wk", "wv", "gate", "up")}
        layers.update(
            wo=RowwiseParallel(output_layouts=Shard(1), use_local_output=local),
            down=RowwiseParallel(output_layouts=Shard(1), use_local_output=local),
            attn_norm=SequenceParallel(),
            mlp_norm=SequenceParallel(),
        )
        embed = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=local)
        norm, head = SequenceParallel(), ColwiseParallel(input_layouts=Shard(1), use_local_output=False)
    for block in model.blocks:
        parallelize_module(block, tp_mesh, layers)
    if model.embed is not None and plan != "head-only":
        parallelize_module(model.embed, tp_mesh, embed)
    if model.norm is not None and norm is not None:
        parallelize_module(model.norm, tp_mesh, norm)
    if model.head is not None:
        parallelize_module(model.head, tp_mesh, head)


def is_parallelized(model: nn.Module) -> bool:
    return any(hasattr(p, "placements") for p in model.parameters())


class LitTPDecoder(L.LightningModule):
    """Trains :class:`TPDecoder`; ``configure_model`` applies ``plan`` when the strategy's mesh has a "tp" axis
    larger than one (a second Trainer entry finds it applied). ``weighted``: the loss is the token mean and the step
    returns ``num_items``; otherwise the sum over tokens divided by the positions (equal for every microbatch and
    replica, so that data-parallel replicas average to one device's loss). ``shuffle=False``: the same batches in
    every epoch, so that a run resumed at an epoch's end sees what an uninterrupted one does."""

    def __init__(
        self,
        plan: str = "plain",
        tied: bool = True,
        n_layers: int = 8,
        lr: float = 0.05,
        weighted: bool = True,
        optimizer: str = "sgd",
        samples: int = 64,
        qk_norm: bool = False,
        build_late: bool = False,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if not build_late:
            self.model = TPDecoder(n_layers=n_layers, tied=tied, qk_norm=qk_norm)
        self.step_losses: list[float] = []
        self.val_losses: list[float] = []

    def configure_model(self) -> None:
        """``build_late``: the network is built here, so the plan splits the whole network before the cut."""
        hp = self.hparams
        if hp.build_late and not hasattr(self, "model"):
            self.model = TPDecoder(n_layers=hp.n_layers, tied=hp.tied, qk_norm=hp.qk_norm)
        mesh = self.device_mesh  # None on one device
        if mesh is None or mesh["tp"].size() == 1 or is_parallelized(self.model) or hp.plan == "none":
            return
        tp_mesh = mesh["tp"]
        if hp.plan == "foreign":  # a mesh of the user's own, over every process: not the stage's
            from torch.distributed.device_mesh import init_device_mesh

            tp_mesh = init_device_mesh(mesh.device_type, (mesh.size(),), mesh_dim_names=("tp",))
        parallelize(self.model, tp_mesh, "plain" if hp.plan == "foreign" else hp.plan)

    def _loss(self, batch):
        idx, mask, labels = batch
        cos, sin = rope_tables(idx.shape[1], DIM // HEADS)
        logits = self.model(idx, mask, cos=cos, sin=sin)
        if self.hparams.weighted:
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
            return loss, (labels != -100).sum()
        total = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
        return total / labels.numel(), None

    def training_step(self, batch, batch_idx):
        loss, n = self._loss(batch)
        self.log("train_loss", loss)
        return {"loss": loss, "num_items": n} if n is not None else loss

    def validation_step(self, batch, batch_idx):
        loss, n = self._loss(batch)
        self.log("val_loss", loss)
        return {"loss": loss, "num_items": n} if n is not None else {"loss": loss}

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.step_losses.append(float(outputs["loss"]))

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if outputs is not None:
            self.val_losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        if self.hparams.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(padded_dataset(self.hparams.samples, seed=0), batch_size=8, shuffle=self.hparams.shuffle)

    def val_dataloader(self):
        return DataLoader(padded_dataset(16, seed=1), batch_size=8)
