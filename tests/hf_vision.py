"""Tiny Hugging Face vision-language models (built from a config, random init: no downloads) inside an ordinary
LightningModule: token ids with a fixed number of image tokens per sample, the images' pixels, and labels on the text
tokens (-100 on the image tokens and the padding)."""

from __future__ import annotations

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.models import quiet_trainer

VOCAB, TEXT, IMAGE_TOKEN = 61, 8, 60
#: image side and patch side: (16 / 8) ** 2 = 4 patches, one image token each
IMAGE, PATCH = 16, 8
LAYERS = 4


def _text(**extra):
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        **extra,
    )


def build(family: str):
    """A tiny ``family`` vision-language model, in float32."""
    import transformers

    if family == "llava":
        vision = transformers.CLIPVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=IMAGE,
            patch_size=PATCH,
            projection_dim=16,
        )
        config = transformers.LlavaConfig(
            vision_config=vision, text_config=transformers.LlamaConfig(**_text()), image_token_index=IMAGE_TOKEN
        )
        return transformers.LlavaForConditionalGeneration(config)
    raise ValueError(family)


def image_tokens(family: str) -> int:
    return (IMAGE // PATCH) ** 2


def batches(family: str, samples: int, seed: int) -> TensorDataset:
    """Per sample: the image tokens, then text (right-padded); the image's pixels; labels on the text."""
    g = torch.Generator().manual_seed(seed)
    n = image_tokens(family)
    text = torch.randint(1, IMAGE_TOKEN, (samples, TEXT), generator=g)
    lengths = torch.randint(3, TEXT + 1, (samples,), generator=g)
    real = torch.arange(TEXT)[None, :] < lengths[:, None]
    ids = torch.cat([torch.full((samples, n), IMAGE_TOKEN), torch.where(real, text, 0)], 1)
    mask = torch.cat([torch.ones(samples, n, dtype=torch.long), real.long()], 1)
    labels = torch.cat([torch.full((samples, n), -100), torch.where(real, text, -100)], 1)
    pixels = torch.randn(samples, 3, IMAGE, IMAGE, generator=g)
    return TensorDataset(ids, mask, labels, pixels)


class LitVision(L.LightningModule):
    def __init__(self, family: str = "llava", freeze_vision: bool = False) -> None:
        super().__init__()
        self.family = family
        torch.manual_seed(0)
        self.model = build(family)
        if freeze_vision:
            for name, p in self.model.named_parameters():
                if "vision" in name or "visual" in name:
                    p.requires_grad_(False)
        self.step_losses: list[float] = []

    def _loss(self, batch):
        ids, mask, labels, pixels = batch
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels, pixel_values=pixels).loss
        return loss, (labels[:, 1:] != -100).sum()

    def training_step(self, batch, batch_idx):
        loss, n = self._loss(batch)
        return {"loss": loss, "num_items": n}

    def validation_step(self, batch, batch_idx):
        loss, n = self._loss(batch)
        self.log("val_loss", loss, batch_size=int(n))

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.step_losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(batches(self.family, 32, 0), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(batches(self.family, 16, 1), batch_size=8)


def run_vision(strategy=None, devices: int = 1, **model_kwargs) -> dict:
    """Fit 4 steps with validation after 2 and 4 (one device when ``strategy`` is None); what the rank saw."""
    L.seed_everything(0)
    model = LitVision(**model_kwargs)
    kwargs = dict(strategy=strategy) if strategy is not None else {}
    trainer = quiet_trainer(devices=devices, max_steps=4, val_check_interval=2, **kwargs)
    trainer.fit(model)
    return {
        "losses": model.step_losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }
