"""PEFT fine-tunes of the tiny pretrained directories of :mod:`tests.hf_pretrained`: ``get_peft_model`` applied in
``configure_model`` (on the meta device under the pipeline, to a network built from the directory's config; on one
device to ``from_pretrained``)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
import torch

from tests.hf_pretrained import LitPretrained
from tests.models import quiet_trainer

#: the tuners the tests run, by name: ``late`` leaves the first layers (and the first stage) without adapters
TUNERS = ("lora", "lora-late", "lora-saved", "loha")


def peft_config(tuner: str):
    import peft

    if tuner == "loha":
        return peft.LoHaConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    if tuner == "lora-late":
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[6, 7])
    if tuner == "lora-saved":  # the final norm trains whole, as a `modules_to_save` copy
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "o_proj"], modules_to_save=["norm"])
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


class LitPeft(LitPretrained):
    """Fine-tunes the directory ``path`` with the adapters of ``tuner``; records the trainable tensors it started
    from and the frozen ones before and after (``initial``, ``frozen``, ``frozen_after``). ``start``: values for the
    trainable tensors at the start of training (the pipeline run's, for a reference with the same adapters).
    ``bare``: the steps as a one-device script has them, the model's own loss returned and logged as it is (no
    ``num_items``, no ``batch_size=``)."""

    def __init__(
        self, path: str, tuner: str, pretrained: bool = False, start: dict | None = None, bare: bool = False
    ) -> None:
        super().__init__(path, pretrained=pretrained)
        self.tuner, self.start, self.bare = tuner, start, bare
        self.initial: dict[str, torch.Tensor] = {}
        self.frozen: dict[str, torch.Tensor] = {}
        self.frozen_after: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        import peft

        if self.model is not None:
            return
        super().configure_model()
        # peft draws the adapters from the global random stream; under the pipeline (init_values="one_device") the
        # same numbers, and the shuffling DataLoader then draws the same order
        self.model = peft.get_peft_model(self.model, peft_config(self.tuner))

    def training_step(self, batch, batch_idx):
        if not self.bare:
            return super().training_step(batch, batch_idx)
        ids, mask, labels = batch
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        ids, mask, labels = batch
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        if self.bare:
            self.log("val_loss", loss)
            return
        # token-weighted: the pipeline's microbatch means then combine into one device's token mean
        self.log("val_loss", loss, batch_size=int((labels[:, 1:] != -100).sum()))

    def on_train_start(self) -> None:
        if self.start is not None:
            with torch.no_grad():
                for name, p in self.named_parameters():
                    if p.requires_grad:
                        p.copy_(self.start[name])
        for name, p in self.named_parameters(remove_duplicate=False):  # a tied head under its own name too
            target = self.initial if p.requires_grad else self.frozen
            target[name] = p.detach().clone()

    def on_train_end(self) -> None:
        params = self.named_parameters(remove_duplicate=False)
        self.frozen_after = {n: p.detach().clone() for n, p in params if not p.requires_grad}

    def configure_optimizers(self):
        # All parameters, not a `requires_grad` filter: a rank whose stages hold no adapter would pass an empty list.
        # Frozen ones get no gradient, so the optimizer skips them and keeps no state for them.
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def fine_tune(
    path: Path,
    tuner: str,
    strategy=None,
    devices: int = 1,
    start: dict | None = None,
    max_steps: int = 4,
    bare: bool = False,
) -> tuple[LitPeft, L.Trainer, float]:
    """Fit ``max_steps`` steps from the directory, then validate; on one device with ``from_pretrained`` when
    ``strategy`` is None. Returns the module, the Trainer and the validation loss."""
    L.seed_everything(0)
    model = LitPeft(str(path), tuner, pretrained=strategy is None, start=start, bare=bare)
    kwargs = {"strategy": strategy} if strategy is not None else {}
    trainer = quiet_trainer(devices=devices, max_steps=max_steps, limit_val_batches=0, **kwargs)
    trainer.fit(model)
    trainer.limit_val_batches = 1.0
    (metrics,) = trainer.validate(model, verbose=False)
    return model, trainer, float(metrics["val_loss"])


def save_adapter(base_dir: Path, out: Path, config, seed: int = 1) -> Path:
    """An adapter directory as ``PeftModel.save_pretrained`` writes it after some training: ``config``'s adapters
    on the directory's model, every trainable tensor drawn at random (the second factors non-zero)."""
    import peft
    import transformers

    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base_dir), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(p + 0.02 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(out)
    return Path(out)


def peft_start(base_dir: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """The trainable tensors ``PeftModel.from_pretrained(base, adapter, is_trainable=True)`` starts from, under the
    LightningModule's names (``model.``)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    model = peft.PeftModel.from_pretrained(base, adapter, is_trainable=True)
    return {f"model.{n}": p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
