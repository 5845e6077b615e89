"""Pretrained Hugging Face model directories for the tests (tiny causal LMs saved with ``save_pretrained`` in several
shards: no downloads), and a LightningModule that fine-tunes one: ``from_pretrained`` on one device, or built from
the directory's config in ``configure_model`` and started from the directory with ``init_weights`` under the
pipeline."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader

from tests.hf_models import LEARNING_RATES, VOCAB, build, padded_batches
from tests.models import quiet_trainer

#: several shards for the tiny models (~80-160 KB of weights)
SHARD_SIZE = "40KB"


def save_pretrained(path: Path, family: str, tie: bool, layers: int = 8, seed: int = 0, **kwargs) -> Path:
    """A tiny ``family`` causal LM with random weights, saved as a Hugging Face directory at ``path``."""
    torch.manual_seed(seed)
    model = build(family, tie, layers)
    model.save_pretrained(path, **{"max_shard_size": SHARD_SIZE, **kwargs})
    return Path(path)


class LitPretrained(L.LightningModule):
    """Fine-tunes the causal LM of the directory ``path``: ``pretrained`` loads it with ``from_pretrained`` (one
    device); otherwise the network is built from its config, or ``config_path``'s (on the meta device under the
    pipeline)."""

    def __init__(self, path: str, pretrained: bool = False, config_path: str | None = None) -> None:
        super().__init__()
        self.path, self.pretrained, self.config_path = str(path), pretrained, str(config_path or path)
        self.model = None
        self.step_losses: list[float] = []

    def configure_model(self) -> None:
        import transformers

        if self.model is not None:
            return
        if self.pretrained:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(self.path, attn_implementation="eager")
            self.model.train()  # from_pretrained returns it in eval mode
        else:
            config = transformers.AutoConfig.from_pretrained(self.config_path)
            self.model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        out = self.model(input_ids=ids, attention_mask=mask, labels=labels)
        return {"loss": out.loss, "num_items": (labels[:, 1:] != -100).sum()}

    def validation_step(self, batch, batch_idx):
        ids, mask, labels = batch
        self.log("val_loss", self.model(input_ids=ids, attention_mask=mask, labels=labels).loss)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.step_losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        lr = LEARNING_RATES.get(self.model.config.model_type, 0.05)
        return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(padded_batches(48, 0, "right"), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(padded_batches(16, 1, "right"), batch_size=8)


def fine_tune(path: Path, strategy=None, devices: int = 1, max_steps: int = 4) -> tuple[LitPretrained, L.Trainer]:
    """Fit ``max_steps`` steps from the directory: on one device with ``from_pretrained`` when ``strategy`` is None."""
    L.seed_everything(0)
    model = LitPretrained(str(path), pretrained=strategy is None)
    kwargs = {"strategy": strategy} if strategy is not None else {}
    trainer = quiet_trainer(devices=devices, max_steps=max_steps, limit_val_batches=0, **kwargs)
    trainer.fit(model)
    return model, trainer


def probe_logits(model: torch.nn.Module) -> torch.Tensor:
    """The logits of a causal LM on a fixed batch of token ids (eval mode, no gradients)."""
    ids = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(5))
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits
