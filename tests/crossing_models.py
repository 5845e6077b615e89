"""Networks whose values cross more than one stage, inside ordinary LightningModules: Lightning's demo transformer
(an nn.Transformer encoder-decoder), a small U-Net, transformers' T5Gemma, a hand-written mixture of experts, and
transformers mixture-of-experts models trained with their load-balancing loss."""

from __future__ import annotations

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import LightningTransformer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.models import quiet_trainer

VOCAB, SEQ = 48, 8
#: microbatches of the pipelined runs (batches of 8 samples)
MICROBATCHES = 4


def token_pairs(samples: int, seed: int, vocab: int = VOCAB, seq: int = SEQ) -> TensorDataset:
    """Synthetic text: random token sequences and the same shifted by one (no download)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (samples, seq + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def dropout_off(module: nn.Module) -> None:
    """No dropout anywhere (nn.Dropout modules and nn.MultiheadAttention's own probability)."""
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0


class _Recording(L.LightningModule):
    """Records each training step's loss; the optimizer is a plain SGD step, small enough for a 1e-5 parity."""

    def __init__(self) -> None:
        super().__init__()
        self.step_losses: list[float] = []

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.step_losses.append(float(outputs["loss"]))


class DemoTransformer(LightningTransformer):
    """Lightning's demo, unchanged but for synthetic text instead of WikiText-2, dropout off, and the validation and
    predict steps the demo does not have."""

    def __init__(self, vocab_size: int = VOCAB, batch_size: int = 8) -> None:
        super().__init__(vocab_size=vocab_size)
        dropout_off(self.model)
        self.batch_size = batch_size
        self.step_losses: list[float] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_pairs(32, 0), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(token_pairs(12, 1), batch_size=4)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(token_pairs(12, 2), batch_size=4)

    def validation_step(self, batch, batch_idx):
        inputs, target = batch
        self.log("val_loss", F.nll_loss(self(inputs, target), target.view(-1)))

    def predict_step(self, batch, batch_idx):
        inputs, target = batch
        return self(inputs, target)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.step_losses.append(float(outputs["loss"]))

    def prepare_data(self) -> None:  # the demo downloads WikiText-2 here
        pass


# ---------------------------------------------------------------------------------------------------- U-Net
class Down(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=2, padding=1)
        self.norm = nn.GroupNorm(4, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.norm(self.conv(x)))


class Up(nn.Module):
    def __init__(self, cin: int, cskip: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin + cskip, cout, 3, padding=1)
        self.norm = nn.GroupNorm(4, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        return F.silu(self.norm(self.conv(torch.cat([x, skip], dim=1))))


class UNet(nn.Module):
    """A U-Net written as usual: each down block's output is kept and read by the matching up block."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inc = nn.Conv2d(1, width, 3, padding=1)
        self.down = nn.ModuleList([Down(width, 2 * width), Down(2 * width, 4 * width)])
        self.mid = nn.Conv2d(4 * width, 4 * width, 3, padding=1)
        self.up = nn.ModuleList([Up(4 * width, 2 * width, 2 * width), Up(2 * width, width, width)])
        self.outc = nn.Conv2d(width, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inc(x)
        skips = [h]
        for block in self.down:
            h = block(h)
            skips.append(h)
        h = F.silu(self.mid(skips.pop()))
        for block in self.up:
            h = block(h, skips.pop())
        return self.outc(h)


def image_pairs(samples: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    clean = torch.randn(samples, 1, 8, 8, generator=g)
    return TensorDataset(clean + 0.3 * torch.randn(samples, 1, 8, 8, generator=g), clean)


class LitUNet(_Recording):
    def __init__(self) -> None:
        super().__init__()
        self.model = UNet()

    def training_step(self, batch, batch_idx):
        noisy, clean = batch
        return F.mse_loss(self.model(noisy), clean)

    def validation_step(self, batch, batch_idx):
        noisy, clean = batch
        self.log("val_loss", F.mse_loss(self.model(noisy), clean))

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(image_pairs(32, 0), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(image_pairs(12, 1), batch_size=4)

    def predict_dataloader(self):
        return DataLoader(image_pairs(12, 2), batch_size=4)


# ---------------------------------------------------------------------------------------------------- T5Gemma
def t5gemma(layers: int = 2):
    import transformers

    module = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    config = transformers.T5GemmaConfig(
        encoder=dict(module), decoder=dict(module), vocab_size=VOCAB, dropout_rate=0.0, attention_dropout=0.0
    )
    config._attn_implementation = "eager"
    return transformers.T5GemmaForConditionalGeneration(config)


class LitSeq2Seq(_Recording):
    """A transformers encoder-decoder (T5Gemma): source tokens in, target tokens as labels."""

    def __init__(self) -> None:
        super().__init__()
        self.model = t5gemma()

    def _out(self, batch):
        source, target = batch
        # Without the decoding cache, as the pipeline runs it (T5Gemma's eval-mode cache changes the logits of
        # sources that contain the pad token: measured 25.518 vs 25.500 summed over a batch, on one device).
        return self.model(input_ids=source, attention_mask=torch.ones_like(source), labels=target, use_cache=False)

    def training_step(self, batch, batch_idx):
        return self._out(batch).loss

    def validation_step(self, batch, batch_idx):
        out = self._out(batch)
        self.log("val_loss", out.loss)
        self.log("val_logit_mean", out.logits.float().mean())

    def predict_step(self, batch, batch_idx):
        return self._out(batch).logits

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(token_pairs(32, 0, vocab=VOCAB - 1), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(token_pairs(12, 1, vocab=VOCAB - 1), batch_size=4)

    def predict_dataloader(self):
        return DataLoader(token_pairs(12, 2, vocab=VOCAB - 1), batch_size=4)


def fit_validate_predict(model: L.LightningModule, strategy=None, devices: int = 1, max_steps: int = 4) -> dict:
    """Fit (validating after every 2 steps), validate, predict; what this rank saw. One device when ``strategy`` is
    None."""
    kwargs = dict(strategy=strategy) if strategy is not None else {}
    trainer = quiet_trainer(devices=devices, max_steps=max_steps, val_check_interval=2, **kwargs)
    return _run(trainer, model)


def accumulated_demo(microbatches: int, max_steps: int = 4) -> dict:
    """The demo on one device accumulating gradients over the pipeline's microbatches (batches of 8 / microbatches,
    drawn in the same order): the same sums in the same order as the pipeline. ``losses`` per optimizer step."""
    L.seed_everything(0)
    model = DemoTransformer(batch_size=8 // microbatches)
    trainer = quiet_trainer(devices=1, max_steps=max_steps, accumulate_grad_batches=microbatches, limit_val_batches=0)
    trainer.fit(model)
    per_batch = model.step_losses  # Lightning reports each accumulated batch's loss divided by `microbatches`
    evaluator = quiet_trainer(devices=1)
    return {
        "losses": [sum(per_batch[i : i + microbatches]) for i in range(0, len(per_batch), microbatches)],
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "validated": evaluator.validate(model, verbose=False),
        "predictions": [p.detach().clone() for p in evaluator.predict(model)],
    }


def _run(trainer: L.Trainer, model: L.LightningModule) -> dict:
    trainer.fit(model)
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    validated = trainer.validate(model, verbose=False)
    predictions = trainer.predict(model)
    return {
        "losses": list(model.step_losses),
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "metrics": fit_metrics,
        "validated": validated,
        "predictions": [None if p is None else p.detach().clone() for p in predictions or []],
        "dp_rank": getattr(trainer.strategy, "data_parallel_rank", 0),
        "pipeline_rank": getattr(trainer.strategy, "pipeline_rank", 0),
    }


#: the models of tests/scripts/crossing.py by name
MODELS = {"demo": DemoTransformer, "unet": LitUNet, "t5gemma": LitSeq2Seq}
