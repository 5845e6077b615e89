"""transformers mixture-of-experts models trained with their load-balancing loss (``output_router_logits=True``).

The load-balancing loss multiplies two batch means (the share of tokens each expert gets and its mean router
probability), so it depends on how a batch is split: a pipeline computes it per microbatch, as one device does when
it accumulates gradients over the same microbatches. ``LitMoE(chunks=M)`` on one device runs exactly that (the step
splits the batch itself); under the pipeline ``chunks=1`` and the strategy splits it into ``M`` microbatches.
"""

from __future__ import annotations

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader

from tests.hf_models import VOCAB, padded_batches
from tests.models import quiet_trainer

MICROBATCHES = 4
#: larger than the families' default (0.001), so that the auxiliary term moves the routers visibly
AUX_COEF = 0.02


def build_moe(family: str, layers: int = 8):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
        output_router_logits=True,
        router_aux_loss_coef=AUX_COEF,
        num_experts_per_tok=2,
    )
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, num_local_experts=4))
    if family == "qwen3_moe":
        # One dense layer: the stage holding it has no router logits of its own.
        config = transformers.Qwen3MoeConfig(
            **common, num_experts=4, moe_intermediate_size=32, head_dim=8, mlp_only_layers=[2]
        )
        return transformers.Qwen3MoeForCausalLM(config)
    raise ValueError(family)


def first_router(state: dict, prefix: str = "model.") -> str:
    """The name of the first MoE layer's router weight (held by the first stage), whatever the family calls its MoE
    block (``block_sparse_moe`` in transformers 4.x Mixtral, ``mlp`` elsewhere)."""
    return next(
        name
        for name in state
        if name.startswith(f"{prefix}model.layers.0.") and name.endswith("gate.weight") and "experts" not in name
    )


class LitMoE(L.LightningModule):
    def __init__(self, family: str = "mixtral", chunks: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build_moe(family)
        self.step_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        chunks = self.hparams.chunks
        outs = [
            self.model(input_ids=i, attention_mask=m, labels=y)
            for i, m, y in zip(ids.chunk(chunks), mask.chunk(chunks), labels.chunk(chunks))
        ]
        items = [(y[:, 1:] != -100).sum() for y in labels.chunk(chunks)]  # the model shifts labels by one
        if chunks == 1:
            self.log("train_aux", outs[0].aux_loss)
            return {"loss": outs[0].loss, "num_items": items[0]}
        # One device, the pipeline's way: each microbatch's loss weighted by its tokens.
        total = sum(items)
        self.log("train_aux", sum(o.aux_loss * n for o, n in zip(outs, items)) / total)
        return sum(o.loss * n for o, n in zip(outs, items)) / total

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.step_losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(padded_batches(32, 0, "right"), batch_size=8, shuffle=True)


def run_moe(family: str, strategy=None, devices: int = 1, max_steps: int = 4) -> dict:
    """Fit 4 steps (one device when ``strategy`` is None, with the pipeline's microbatches); what the rank saw."""
    L.seed_everything(0)
    model = LitMoE(family, chunks=1 if strategy is not None else MICROBATCHES)
    kwargs = dict(strategy=strategy) if strategy is not None else {}
    trainer = quiet_trainer(devices=devices, max_steps=max_steps, **kwargs)
    trainer.fit(model)
    return {
        "losses": model.step_losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "dp_rank": getattr(trainer.strategy, "data_parallel_rank", 0),
        "pipeline_rank": getattr(trainer.strategy, "pipeline_rank", 0),
    }
