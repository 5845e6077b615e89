"""Hugging Face task heads (tiny, saved with ``save_pretrained``: no downloads) fine-tuned in an ordinary
LightningModule: a reward model (``LlamaForSequenceClassification``, ``num_labels=1``, MSE), a classifier
(3 labels, cross-entropy), a tagger (``Qwen2ForTokenClassification``) and an extractive QA head
(``Qwen2ForQuestionAnswering``). On one device the network comes from ``from_pretrained``; under the pipeline it is
built from the directory's config in ``configure_model`` and started from the directory with ``init_weights``."""

from __future__ import annotations

import contextlib
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.hf_models import SEQ, VOCAB, padded_batches
from tests.models import quiet_trainer

#: task -> (transformers class, family, num_labels)
TASKS = {
    "reward": ("LlamaForSequenceClassification", "llama", 1),
    "classifier": ("LlamaForSequenceClassification", "llama", 3),
    "tagger": ("Qwen2ForTokenClassification", "qwen2", 5),
    "qa": ("Qwen2ForQuestionAnswering", "qwen2", 2),
}
LAYERS = 4
#: A Llama sequence classifier's pipeline plan as a user gives it (``model_plan``) for a family without one: the tests
#: remove transformers' own (:func:`without_plan`).
USER_PLAN = {
    "model.embed_tokens": (["input_ids"], ["inputs_embeds"]),
    "model.layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
    "model.norm": (["hidden_states"], ["hidden_states"]),
    "score": (["hidden_states"], ["logits"]),
}


@contextlib.contextmanager
def without_plan():
    """LlamaConfig without its pipeline plan (``base_model_pp_plan = None``), as a family transformers does not
    describe."""
    import transformers

    saved = transformers.LlamaConfig.__dict__.get("base_model_pp_plan")
    transformers.LlamaConfig.base_model_pp_plan = None
    try:
        yield
    finally:
        transformers.LlamaConfig.base_model_pp_plan = saved


def config(task: str):
    import transformers

    _, family, labels = TASKS[task]
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        num_labels=labels,
        classifier_dropout=0.0,  # the tagger's head dropout (0.1 by default) draws other numbers than on one device
    )
    cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    return cls(**common)


def save_pretrained(path: Path, task: str, seed: int = 0, causal_lm: bool = False) -> Path:
    """A tiny ``task`` model with random weights (or, ``causal_lm``, its family's causal LM) saved at ``path``."""
    import transformers

    torch.manual_seed(seed)
    cls = getattr(transformers, TASKS[task][0] if not causal_lm else TASKS[task][1].capitalize() + "ForCausalLM")
    cls(config(task)).save_pretrained(path, max_shard_size="40KB")
    return Path(path)


def batches(task: str, samples: int, seed: int, side: str) -> TensorDataset:
    """Padded token ids with the task's targets: a score, a class, a tag per token (-100 on padding) or a span."""
    ids, mask, _ = padded_batches(samples, seed, side).tensors
    g = torch.Generator().manual_seed(seed + 100)
    if task == "reward":
        return TensorDataset(ids, mask, torch.rand(samples, generator=g))
    if task == "classifier":
        return TensorDataset(ids, mask, torch.randint(0, 3, (samples,), generator=g))
    if task == "tagger":
        tags = torch.randint(0, 5, (samples, SEQ), generator=g)
        return TensorDataset(ids, mask, torch.where(mask.bool(), tags, torch.full_like(tags, -100)))
    start = torch.randint(0, SEQ // 2, (samples,), generator=g)
    end = start + torch.randint(0, SEQ // 2, (samples,), generator=g)
    return TensorDataset(ids, mask, torch.stack([start, end], 1))


def lora_config():
    """The LoRA reward-model recipe: ``task_type="SEQ_CLS"`` puts the head (``score``) in ``modules_to_save``."""
    import peft

    return peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


class LitHead(L.LightningModule):
    """Fine-tunes the task model of the directory ``path``; ``user_loss``: the step computes the loss from ``logits``
    itself instead of passing ``labels=``; ``lora``: with :func:`lora_config`'s adapters, recording the trainable
    tensors it starts from (``initial``) and whether the frozen ones stay bitwise unchanged (``frozen_unchanged``);
    ``start``: values for the trainable tensors at the start (the pipeline run's adapters, for a reference);
    ``bare``: the steps of a one-device script, the model's own loss returned and logged as it is (no ``num_items``, no
    ``batch_size=``)."""

    def __init__(
        self,
        path: str,
        task: str,
        side: str = "right",
        pretrained: bool = False,
        user_loss: bool = False,
        lora: bool = False,
        start: dict | None = None,
        bare: bool = False,
    ):
        super().__init__()
        self.bare = bare
        self.path, self.task, self.side, self.pretrained, self.user_loss = str(path), task, side, pretrained, user_loss
        self.lora, self.start = lora, start
        self.initial: dict[str, torch.Tensor] = {}
        self.frozen: dict[str, torch.Tensor] = {}
        self.frozen_unchanged: bool | None = None
        self.model = None
        self.step_losses: list[float] = []
        self.val_losses: list[float] = []  # the logged validation loss, after each validation

    def configure_model(self) -> None:
        import transformers

        if self.model is not None:
            return
        cls = getattr(transformers, TASKS[self.task][0])
        if self.pretrained:
            self.model = cls.from_pretrained(self.path, attn_implementation="eager")
            self.model.train()  # from_pretrained returns it in eval mode
        else:
            self.model = cls(transformers.AutoConfig.from_pretrained(self.path, attn_implementation="eager"))
        if self.lora:
            import peft

            # one device draws the adapters from the global stream: kept apart, so the data order stays the same
            with torch.random.fork_rng():
                self.model = peft.get_peft_model(self.model, lora_config())

    def on_train_start(self) -> None:
        if not self.lora:
            return
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.requires_grad and self.start is not None:
                    p.copy_(self.start[name])
        for name, p in self.named_parameters():
            (self.initial if p.requires_grad else self.frozen)[name] = p.detach().clone()

    def _loss(self, batch) -> torch.Tensor:
        ids, mask, target = batch
        if self.task == "qa":
            start, end = target[:, 0], target[:, 1]
            if not self.user_loss:
                return self.model(input_ids=ids, attention_mask=mask, start_positions=start, end_positions=end).loss
            out = self.model(input_ids=ids, attention_mask=mask)
            return (F.cross_entropy(out.start_logits, start) + F.cross_entropy(out.end_logits, end)) / 2
        if not self.user_loss:
            return self.model(input_ids=ids, attention_mask=mask, labels=target).loss
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        if self.task == "reward":
            return F.mse_loss(logits.squeeze(-1), target)
        return F.cross_entropy(logits.flatten(0, -2), target.flatten(), ignore_index=-100)

    def _items(self, batch) -> torch.Tensor:
        """What the loss averages over: the tagger's real tokens (a microbatch's mean counts as many), else samples."""
        target = batch[2]
        return (target != -100).sum() if self.task == "tagger" else torch.tensor(len(target))

    def training_step(self, batch, batch_idx):
        if self.bare:
            return self._loss(batch)
        return {"loss": self._loss(batch), "num_items": self._items(batch)}

    def validation_step(self, batch, batch_idx):
        if self.bare:
            self.log("val_loss", self._loss(batch))
            return
        self.log("val_loss", self._loss(batch), batch_size=int(self._items(batch)))

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if "val_loss" in self.trainer.callback_metrics and self.trainer.global_step % 2 == 0 and batch_idx:
            self.val_losses.append(float(self.trainer.callback_metrics["val_loss"]))

    def on_train_end(self) -> None:
        self.val_losses.append(float(self.trainer.callback_metrics["val_loss"]))
        if self.lora:
            params = dict(self.named_parameters())
            self.frozen_unchanged = all(torch.equal(params[n], v) for n, v in self.frozen.items())

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.step_losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(batches(self.task, 32, 0, self.side), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(batches(self.task, 16, 1, self.side), batch_size=8)


def fine_tune(path: Path, task: str, strategy=None, devices: int = 1, **kwargs) -> tuple[LitHead, L.Trainer]:
    """Fit 4 steps from the directory, validating after 2 and 4: on one device with ``from_pretrained`` when
    ``strategy`` is None."""
    L.seed_everything(0)
    model = LitHead(str(path), task, pretrained=strategy is None, **kwargs)
    extra = {"strategy": strategy} if strategy is not None else {}
    trainer = quiet_trainer(devices=devices, max_steps=4, val_check_interval=2, **extra)
    trainer.fit(model)
    return model, trainer


def probe(network: torch.nn.Module) -> torch.Tensor:
    """The head's outputs on a fixed padded batch (eval mode, no gradients)."""
    ids, mask, _ = padded_batches(4, 7, "right").tensors
    network.eval()
    with torch.no_grad():
        out = network(input_ids=ids, attention_mask=mask)
    return torch.cat([out.start_logits, out.end_logits], -1) if hasattr(out, "start_logits") else out.logits
