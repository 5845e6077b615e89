"""Models built in ``configure_model`` (meta device) for the init and memory tests: the GPT-2-style network with its
own ``_init_weights`` (tests/gpt2.py), the same network initialised by a free function (``apply(gpt2_init)``) or by a
loop over ``named_parameters()``, and a Hugging Face Llama built from a config."""

from __future__ import annotations

import functools
import math

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.gpt2 import GPT2, GPT2Body, gpt2_init

VOCAB, SEQ = 256, 16


class LitMetaGPT2(L.LightningModule):
    def __init__(self, family: str = "gpt2") -> None:
        super().__init__()
        self.family = family

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        if self.family == "gpt2":
            self.model = GPT2(vocab=VOCAB, block_size=SEQ, n_layer=8, n_head=2, n_embd=64)
        elif self.family == "free":
            self.model = GPT2Body(vocab=VOCAB, block_size=SEQ, n_layer=8, n_head=2, n_embd=64)
            self.model.apply(functools.partial(gpt2_init, n_layer=8))
        elif self.family == "loop":
            self.model = GPT2Body(vocab=VOCAB, block_size=SEQ, n_layer=8, n_head=2, n_embd=64)
            init_by_loop(self.model, n_layer=8)
        else:
            import transformers

            config = transformers.LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=8,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
            )
            self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.model(input_ids=x).logits if self.family == "llama" else self.model(x)
        return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self):
        # lr=0: one step creates Adam's state and leaves the initial weights in place.
        return torch.optim.Adam(self.parameters(), lr=0.0)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (8, SEQ + 1), generator=g)
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)


def init_by_loop(network: nn.Module, n_layer: int) -> None:
    """GPT-2's distribution written as a loop: ``nn.init`` calls, ``p.data.normal_()`` and fills under no_grad."""
    for name, p in network.named_parameters():
        if name.endswith("c_proj.weight"):
            p.data.normal_(0.0, 0.02 / math.sqrt(2 * n_layer))
        elif p.dim() >= 2:
            nn.init.normal_(p, mean=0.0, std=0.02)
        elif name.endswith("bias"):
            with torch.no_grad():
                p.fill_(0.0)
        else:
            nn.init.ones_(p)


def run_meta(family: str, devices: int, **strategy_kwargs) -> dict:
    """One optimizer step under the pipeline; the rank's initial weights and memory report."""
    import lightning_pipe

    L.seed_everything(0)
    model = LitMetaGPT2(family)
    strategy = lightning_pipe.PipelineParallelStrategy(**strategy_kwargs)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    report = strategy.memory_report
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "parameters": report.state.parameters,
        "optimizer_state": report.state.optimizer_state,
        "construction_peak": report.construction_peak,
        "saved": report.saved_per_microbatch,
        "dp_rank": 0,
    }
