"""The Fabric loop of the Fabric tests, written once: the same loop runs under ``Fabric(devices=1)`` (the reference,
in the test's process) and under ``Fabric(strategy="pipeline")`` (``tests/scripts/fabric_parity.py``).

The only difference between the two is the line the docs show as the change: ``loss = model.step(forward_and_loss,
batch)`` instead of ``loss = forward_and_loss(batch)``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset

from tests.gpt2 import GPT2

VOCAB, BLOCK, BATCH = 64, 16, 8


def dataset(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randint(0, VOCAB, (steps * BATCH, BLOCK), generator=g)
    return TensorDataset(x[:, :-1], x[:, 1:])


def sft_targets(data: TensorDataset) -> TensorDataset:
    """``data`` with each row's targets past its own length ignored (-100), as litgpt's SFT batches are padded: rows
    and microbatches hold different numbers of labelled tokens."""
    x, y = data.tensors
    y = y.clone()
    for row in range(len(y)):
        y[row, 3 + (row * 7) % (BLOCK - 4) :] = -100
    return TensorDataset(x, y)


def build_gpt(fabric: Any, meta: bool = False, n_layer: int = 4) -> torch.nn.Module:
    with fabric.init_module(empty_init=meta):
        return GPT2(vocab=VOCAB, block_size=BLOCK, n_layer=n_layer, n_head=2, n_embd=32)


def train(fabric: Any, cfg: dict[str, Any], pipelined: bool) -> tuple[list[float], dict[str, torch.Tensor], list]:
    """Per-step losses (as ``fabric.all_reduce`` gives them), this rank's final weights and the clip norms."""
    fabric.seed_everything(0)
    accumulate, steps = cfg.get("accumulate", 1), cfg.get("steps", 4)
    model = fabric.setup_module(build_gpt(fabric, cfg.get("meta", False), cfg.get("n_layer", 4)))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    # `batch`: the global batch (its samples are shared out over data-parallel replicas by the sampler).
    batch, replicas = cfg.get("batch", BATCH), cfg.get("replicas", 1)
    data = dataset(steps * accumulate * batch // BATCH)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=batch // replicas))

    def forward_and_loss(batch: Any) -> Any:
        x, y = batch
        logits = model(x)  # (B, T, vocab)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        # `weighted`: token-weighted, as a step function under the pipeline may return it
        return {"loss": loss, "num_items": torch.tensor(y.numel())} if cfg.get("weighted") and pipelined else loss

    # litgpt's scripts keep the loop's position in the state they save (`fabric.save(path, state)`).
    state = {"model": model, "optimizer": optimizer, "iter_num": 0}
    if cfg.get("resume_from"):
        fabric.load(cfg["resume_from"], state)
    losses, norms = [], []
    for i, batch in enumerate(loader):
        if i < state["iter_num"]:
            continue
        accumulating = (i + 1) % accumulate != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = model.step(forward_and_loss, batch) if pipelined else forward_and_loss(batch)
            fabric.backward(loss / accumulate)
        if not accumulating:
            if cfg.get("clip"):
                norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=cfg["clip"])))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach())))
        state["iter_num"] = i + 1
        if cfg.get("save_at") == i + 1:
            fabric.save(cfg["save_to"], state)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, weights, norms


def build_litgpt(fabric: Any, meta: bool = False, lora: bool = False, n_layer: int = 4) -> torch.nn.Module:
    """litgpt's ``GPT``; with ``lora``, ``litgpt.lora.GPT`` with adapters on every projection, its base frozen (as
    litgpt's LoRA fine-tune script sets it up; no LoRA dropout, whose draws differ with the microbatch split)."""
    sizes = dict(block_size=BLOCK, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=n_layer, n_head=2, n_embd=32)
    if not lora:
        from litgpt import GPT, Config

        with fabric.init_module(empty_init=meta):
            return GPT(Config(**sizes))
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    adapters = dict(lora_query=True, lora_value=True, lora_projection=True, lora_mlp=True, lora_head=True)
    with fabric.init_module(empty_init=meta):
        model = GPT(Config(**sizes, lora_r=4, lora_alpha=8, lora_dropout=0.0, **adapters))
    mark_only_lora_as_trainable(model)
    return model


def train_litgpt(fabric: Any, cfg: dict[str, Any], pipelined: bool) -> tuple[list[float], dict[str, Any], list]:
    """litgpt's full fine-tune loop (``litgpt/finetune/full.py``'s ``fit``), with its chunked cross-entropy and,
    when ``cfg["chunk"]``, its LoRA script's ``lm_head_chunk_size``; with ``cfg["lora"]``, its LoRA fine-tune
    (``litgpt/finetune/lora.py``: ``litgpt.lora.GPT``, the optimizer over the trainable parameters). With
    ``cfg["checkpoint"]`` the weights come from that file of the whole model, loaded as litgpt's scripts load it
    (its strict ``load_checkpoint``; ``fabric.load_raw`` with ``cfg["raw"]``); ``cfg["sft"]``: targets padded with
    -100 (:func:`sft_targets`); ``cfg["weighted"]``: the pipelined step returns the labelled tokens as ``num_items``."""
    from litgpt.utils import chunked_cross_entropy, load_checkpoint

    fabric.seed_everything(0)
    accumulate, steps, chunk = cfg.get("accumulate", 1), cfg.get("steps", 4), cfg.get("chunk", 0)
    built = build_litgpt(fabric, cfg.get("meta", False), cfg.get("lora", False), cfg.get("n_layer", 4))
    model = fabric.setup_module(built)
    if cfg.get("checkpoint"):
        if cfg.get("raw"):
            fabric.load_raw(cfg["checkpoint"], model)
        else:
            load_checkpoint(fabric, model, cfg["checkpoint"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = fabric.setup_optimizers(torch.optim.SGD(trainable, lr=0.05, momentum=0.9))
    # `batch`: the global batch (its samples are shared out over data-parallel replicas by the sampler).
    batch, replicas = cfg.get("batch", BATCH), cfg.get("replicas", 1)
    data = dataset(steps * accumulate * batch // BATCH)
    data = sft_targets(data) if cfg.get("sft") else data
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=batch // replicas))

    def forward_and_loss(batch: Any) -> Any:
        input_ids, targets = batch
        if chunk:
            logits = model(input_ids, lm_head_chunk_size=chunk)
            logits[-1] = logits[-1][..., :-1, :]
            loss = chunked_cross_entropy(logits, targets[..., 1:])
        else:
            logits = model(input_ids)
            loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])
        if cfg.get("weighted") and pipelined:  # the batch's mean over labelled tokens, whatever the microbatches hold
            return {"loss": loss, "num_items": (targets[..., 1:] != -100).sum()}
        return loss

    # litgpt's scripts keep the loop's position in the state they save (`fabric.save(path, state)`).
    state = {"model": model, "optimizer": optimizer, "iter_num": 0}
    if cfg.get("resume_from"):
        fabric.load(cfg["resume_from"], state)
    losses, norms = [], []
    for i, batch in enumerate(loader):
        if i < state["iter_num"]:
            continue
        accumulating = (i + 1) % accumulate != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = model.step(forward_and_loss, batch) if pipelined else forward_and_loss(batch)
            fabric.backward(loss / accumulate)
        if not accumulating:
            if cfg.get("clip"):
                norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=cfg["clip"])))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach())))
        state["iter_num"] = i + 1
        if cfg.get("save_at") == i + 1:
            fabric.save(cfg["save_to"], state)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, weights, norms


class LitGPT2(L.LightningModule):
    """:func:`train`'s loop as a LightningModule (the network as ``self.model``), over batches ``[first, last)`` of
    the data of a ``steps``-step run."""

    def __init__(self, first: int, last: int, steps: int = 4, schedulers: bool = False) -> None:
        super().__init__()
        self.first, self.last, self.steps, self.schedulers = first, last, steps, schedulers
        self.model = GPT2(vocab=VOCAB, block_size=BLOCK, n_layer=4, n_head=2, n_embd=32)
        self.step_losses: list[float] = []
        self.loaded: dict = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)  # (B, T, vocab)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.step_losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if self.schedulers:
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1)]
        return optimizer

    def train_dataloader(self):
        indices = range(self.first * BATCH, self.last * BATCH)
        return DataLoader(Subset(dataset(self.steps), indices), batch_size=BATCH)

    def on_save_checkpoint(self, checkpoint) -> None:
        checkpoint["iter_num"] = self.first + self.global_step  # what the Fabric loop keeps in its state

    def on_load_checkpoint(self, checkpoint) -> None:
        self.loaded = {k: checkpoint[k] for k in ("iter_num",) if k in checkpoint}
