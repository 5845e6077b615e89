"""Tiny Hugging Face vision-language models (built from a config, random init: no downloads) inside an ordinary
LightningModule: token ids with a fixed number of image tokens per sample, the images' pixels, and labels on the text
tokens (-100 on the image tokens and the padding)."""

from __future__ import annotations

import inspect

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.models import quiet_trainer

VOCAB, TEXT, IMAGE_TOKEN = 61, 8, 60
#: image side and patch side: (16 / 8) ** 2 = 4 patches, one image token each
IMAGE, PATCH = 16, 8
LAYERS = 4


def _text(layers: int = LAYERS, **extra):
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        **extra,
    )


def build(family: str, layers: int = LAYERS):
    """A tiny ``family`` vision-language model, in float32, with ``layers`` text layers."""
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
            vision_config=vision, text_config=transformers.LlamaConfig(**_text(layers)), image_token_index=IMAGE_TOKEN
        )
        return transformers.LlavaForConditionalGeneration(config)
    if family == "qwen2_vl":  # 3-D rope positions from input_ids and image_grid_thw
        vision = dict(
            depth=2,
            embed_dim=16,
            num_heads=2,
            mlp_ratio=2,
            patch_size=PATCH // 2,
            spatial_merge_size=2,
            temporal_patch_size=2,
            hidden_size=32,
        )
        text = _text(layers, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]})
        config = transformers.Qwen2VLConfig(
            vision_config=vision,
            text_config=text,
            image_token_id=IMAGE_TOKEN,
            video_token_id=IMAGE_TOKEN - 1,
            vision_start_token_id=IMAGE_TOKEN - 2,
            vision_end_token_id=IMAGE_TOKEN - 3,
        )
        if not hasattr(config, "vocab_size"):  # transformers 4.54's loss reads it from the composite config
            config.vocab_size = VOCAB
        return transformers.Qwen2VLForConditionalGeneration(config)
    if family == "gemma3":  # bidirectional attention among each image's tokens (token_type_ids)
        vision = transformers.SiglipVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=IMAGE,
            patch_size=PATCH // 2,
        )
        text = transformers.Gemma3TextConfig(**_text(layers, head_dim=8, sliding_window=4))
        config = transformers.Gemma3Config(
            vision_config=vision,
            text_config=text,
            mm_tokens_per_image=4,
            image_token_index=IMAGE_TOKEN,
            boi_token_index=IMAGE_TOKEN - 1,
            eoi_token_index=IMAGE_TOKEN - 2,
        )
        return transformers.Gemma3ForConditionalGeneration(config)
    raise ValueError(family)


def image_tokens(family: str) -> int:
    return (IMAGE // PATCH) ** 2


def pixels(family: str, samples: int, g: torch.Generator) -> torch.Tensor:
    """One image per sample: ``(samples, 3, IMAGE, IMAGE)``; Qwen2-VL's as its processor flattens them, per sample
    ``(patches, 3 * 2 * patch * patch)`` (the step joins the samples' patches)."""
    if family == "qwen2_vl":
        patches = (IMAGE // (PATCH // 2)) ** 2
        return torch.randn(samples, patches, 3 * 2 * (PATCH // 2) ** 2, generator=g)
    return torch.randn(samples, 3, IMAGE, IMAGE, generator=g)


def batches(family: str, samples: int, seed: int) -> TensorDataset:
    """Per sample: the image's tokens (Qwen2-VL's after its vision-start token), then text (right-padded); the
    image's pixels; labels on the text."""
    g = torch.Generator().manual_seed(seed)
    image = [IMAGE_TOKEN - 2] * (family == "qwen2_vl") + [IMAGE_TOKEN] * image_tokens(family)
    n = len(image)
    text = torch.randint(1, IMAGE_TOKEN - 3, (samples, TEXT), generator=g)
    lengths = torch.randint(3, TEXT + 1, (samples,), generator=g)
    real = torch.arange(TEXT)[None, :] < lengths[:, None]
    ids = torch.cat([torch.tensor(image).expand(samples, n), torch.where(real, text, 0)], 1)
    mask = torch.cat([torch.ones(samples, n, dtype=torch.long), real.long()], 1)
    labels = torch.cat([torch.full((samples, n), -100), torch.where(real, text, -100)], 1)
    return TensorDataset(ids, mask, labels, pixels(family, samples, g))


class LitVision(L.LightningModule):
    """Fine-tunes a tiny vision-language model: built in ``__init__``, or from the directory ``path``'s config in
    ``configure_model`` (``pretrained``: ``from_pretrained`` of it); ``freeze_vision``: the vision tower is frozen."""

    def __init__(
        self,
        family: str = "llava",
        freeze_vision: bool = False,
        path: str | None = None,
        pretrained: bool = False,
        layers: int = LAYERS,
    ) -> None:
        super().__init__()
        self.family, self.freeze_vision, self.path, self.pretrained = family, freeze_vision, path, pretrained
        torch.manual_seed(0)
        self.model = build(family, layers) if path is None else None
        self.step_losses: list[float] = []

    def configure_model(self) -> None:
        import transformers

        if self.model is None:
            cls = type(build(self.family))
            if self.pretrained:
                self.model = cls.from_pretrained(self.path, attn_implementation="eager")
                self.model.train()
            else:
                self.model = cls(transformers.AutoConfig.from_pretrained(self.path, attn_implementation="eager"))
        if self.freeze_vision:
            for name, p in self.model.named_parameters():
                if "vision_tower" in name or "visual" in name:
                    p.requires_grad_(False)

    def _loss(self, batch, logits: bool = False):
        ids, mask, labels, pixels = batch
        extra = {}
        if self.family == "qwen2_vl":
            side = IMAGE // (PATCH // 2)
            extra["image_grid_thw"] = torch.tensor([[1, side, side]] * len(ids))
            pixels = pixels.flatten(0, 1)  # the samples' patches, one after the other
            if "mm_token_type_ids" in inspect.signature(type(self.model).forward).parameters:
                # transformers >= 5.x computes the 3-D rope positions from it (its processor returns it): 1 on images
                extra["mm_token_type_ids"] = (ids == IMAGE_TOKEN).long()
        if self.family == "gemma3":
            extra["token_type_ids"] = (ids == IMAGE_TOKEN).long()
        out = self.model(input_ids=ids, attention_mask=mask, labels=labels, pixel_values=pixels, **extra)
        return out.logits if logits else (out.loss, (labels[:, 1:] != -100).sum())

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
        # its own generator: from_pretrained of some families (Llava) draws from the global stream, which building
        # from the config on the meta device does not, and the order must not depend on how the model was built
        order = torch.Generator().manual_seed(0)
        return DataLoader(batches(self.family, 32, 0), batch_size=8, shuffle=True, generator=order)

    def val_dataloader(self):
        return DataLoader(batches(self.family, 16, 1), batch_size=8)


def save_pretrained(path, family: str):
    """The tiny ``family`` model's random weights as a Hugging Face directory at ``path``."""
    torch.manual_seed(1)
    build(family).save_pretrained(path, max_shard_size="40KB")
    return path


def probe(network: torch.nn.Module, family: str) -> torch.Tensor:
    """The logits on a fixed batch with images (eval mode, no gradients)."""
    model = LitVision(family)
    model.model = network
    network.eval()
    ids, mask, labels, pixels = batches(family, 3, 9).tensors
    with torch.no_grad():
        return model._loss((ids, mask, None, pixels), logits=True)


def run_vision(devices: int = 1, **model_kwargs) -> dict:
    """Fit 4 steps on one device with validation after 2 and 4; what the run saw."""
    L.seed_everything(0)
    model = LitVision(**model_kwargs)
    trainer = quiet_trainer(devices=devices, max_steps=4, val_check_interval=2)
    trainer.fit(model)
    return {
        "losses": model.step_losses,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "model": model,
    }
