"""Unmodified Hugging Face causal LMs (built from a config, random init) inside an ordinary LightningModule."""

from __future__ import annotations

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.models import quiet_trainer

VOCAB, SEQ = 61, 9
#: Learning rates other than 0.05, by family: at 0.05 the tiny Gemma 4's loss rises from step to step, and that
#: unstable training magnifies float summation-order differences (1e-7 after a step) past 1e-5 within four steps.
LEARNING_RATES = {"gemma4_text": 0.002}


def build(family: str, tie: bool, layers: int = 8):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    if family == "qwen3":  # per-head query/key norms (q_norm, k_norm)
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=8))
    from tests.hf_families import build as build_family  # any other family of transformers' registry, tiny

    return build_family(family, tie, layers)


def padded_batches(samples: int, seed: int, side: str) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (samples, SEQ), generator=g)
    lengths = torch.randint(3, SEQ + 1, (samples,), generator=g)
    positions = torch.arange(SEQ)[None, :]
    real = positions < lengths[:, None] if side == "right" else positions >= (SEQ - lengths[:, None])
    mask = real.long()
    ids = torch.where(real, tokens, torch.zeros_like(tokens))
    labels = torch.where(real, tokens, torch.full_like(tokens, -100))
    return TensorDataset(ids, mask, labels)


class LitHF(L.LightningModule):
    """``built``: where the model is built, ``"init"`` (``__init__``) or ``"configure_model"`` (on the meta device
    under the pipeline, its initial values one device's)."""

    def __init__(
        self,
        family: str = "llama",
        tie: bool = True,
        side: str = "right",
        layers: int = 8,
        weighted: bool = True,
        built: str = "init",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build(family, tie, layers) if built == "init" else None
        self.step_losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build(self.hparams.family, self.hparams.tie, self.hparams.layers)

    def _out(self, batch):
        ids, mask, labels = batch
        out = self.model(input_ids=ids, attention_mask=mask, labels=labels)
        return out, (labels[:, 1:] != -100).sum()  # the model shifts labels by one

    def training_step(self, batch, batch_idx):
        out, n = self._out(batch)
        self.log("train_loss", out.loss)
        # token-weighted (the batch's token mean), or each microbatch's token mean weighted by its samples (said as
        # `num_items`: the model's own loss returned alone would be counted by tokens under `ddp`, not under `fsdp`)
        samples = torch.tensor(len(out.logits))
        return {"loss": out.loss, "num_items": n if self.hparams.weighted else samples}

    def validation_step(self, batch, batch_idx):
        out, n = self._out(batch)
        self.log("val_loss", out.loss, batch_size=int(n))
        self.log("val_logit_mean", out.logits.float().mean())

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.step_losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        # A moderate SGD step: gradients agree with one device to ~1e-7 (float summation order); a large step (or
        # Adam's division by tiny second moments) magnifies that over a few steps past a 1e-5 weight tolerance.
        lr = LEARNING_RATES.get(self.hparams.family, 0.05)
        return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(padded_batches(48, 0, self.hparams.side), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(padded_batches(20, 1, self.hparams.side), batch_size=8)


def run_hf(strategy=None, devices: int = 1, max_steps: int = 4, **model_kwargs) -> dict:
    """Fit 4 steps with validation after 2 and 4 (one device when ``strategy`` is None); what the rank saw."""
    L.seed_everything(0)
    model = LitHF(**model_kwargs)
    kwargs = dict(strategy=strategy) if strategy is not None else {}
    trainer = quiet_trainer(devices=devices, max_steps=max_steps, val_check_interval=2, **kwargs)
    trainer.fit(model)
    return {
        "losses": model.step_losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "dp_rank": getattr(trainer.strategy, "data_parallel_rank", 0),
        "pipeline_rank": getattr(trainer.strategy, "pipeline_rank", 0),
    }
