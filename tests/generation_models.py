"""A tiny causal LM that generates in ``validation_step`` and ``predict_step`` (left-padded prompts), run on one
device or under a pipeline: what each rank generated and logged."""

from __future__ import annotations

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader

from tests.hf_models import VOCAB, padded_batches
from tests.models import quiet_trainer

#: the token that ends a sequence: frequent enough in the tiny models' greedy and sampled outputs that some rows stop
#: before max_new_tokens
EOS, PAD, NEW_TOKENS = 7, 0, 6


def build(family: str, layers: int):
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
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=1,
    )
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if family == "mistral":  # a sliding window shorter than prompt + new tokens: the cache keeps only the window
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=5))
    raise ValueError(family)


def peft_config(tuner: str):
    """The adapters of ``tuner`` with values of their own (peft's default LoRA/LoHa init leaves the model unchanged,
    which would hide adapters a stage did not apply); ``lora`` also trains the final norm whole
    (``modules_to_save``)."""
    import peft

    if tuner == "loha":
        return peft.LoHaConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_weights=False)
    if tuner == "lora":
        return peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["norm"], init_lora_weights=False
        )
    raise ValueError(tuner)


class LitGenerate(L.LightningModule):
    """``tuner``: the model wrapped by ``peft.get_peft_model`` with those adapters (:func:`peft_config`)."""

    def __init__(self, family: str = "llama", layers: int = 4, sample: bool = False, tuner: str | None = None) -> None:
        super().__init__()
        self.model = build(family, layers)
        if tuner is not None:
            import peft

            self.model = peft.get_peft_model(self.model, peft_config(tuner))
        self.sample = sample
        self.generated: list[torch.Tensor] = []

    def _generate(self, batch):
        ids, mask, _ = batch
        options = dict(do_sample=True, top_k=20, temperature=0.9) if self.sample else dict(do_sample=False)
        return self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, **options)

    def validation_step(self, batch, batch_idx):
        if self.sample:
            torch.manual_seed(100 + batch_idx)  # samples reproducible per batch, whatever ran before
        out = self._generate(batch)
        new = out[:, batch[0].shape[1] :]
        self.generated.append(out)
        self.log("val_new_tokens", (new != PAD).sum(dim=1).float().mean())
        self.log("val_token_rms", new.float().pow(2).mean().sqrt())
        self.log("val_eos_rate", (new == EOS).any(dim=1).float().mean(), prog_bar=True)

    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return self._generate(batch)

    def val_dataloader(self):
        return DataLoader(padded_batches(12, 1, "left"), batch_size=4)

    def test_dataloader(self):
        return DataLoader(padded_batches(8, 3, "left"), batch_size=4)

    def predict_dataloader(self):
        return DataLoader(padded_batches(10, 2, "left"), batch_size=4)


def run_generation(make_strategy=None, devices: int = 1, test: bool = False, **model_kwargs) -> dict:
    """Validate, test (with ``test``) then predict (each with a fresh seed and a strategy from ``make_strategy()``; one
    device when it is None); what the rank generated, logged and predicted."""

    def trainer():
        return quiet_trainer(devices=devices, **(dict(strategy=make_strategy()) if make_strategy else {}))

    L.seed_everything(0)
    model = LitGenerate(**model_kwargs)
    metrics = trainer().validate(model, verbose=False)[0]
    if test:
        L.seed_everything(2)
        metrics |= {f"test/{k}": v for k, v in trainer().test(model, verbose=False)[0].items()}
    L.seed_everything(1)
    predictions = trainer().predict(model)
    return {
        "generated": [t.cpu() for t in model.generated],
        "metrics": {k: float(v) for k, v in metrics.items()},
        "predictions": [t.cpu() for t in predictions or [] if t is not None] or None,
    }
