"""Token means without ``num_items``: the items a transformers model's own loss averages over, counted while it runs
(:mod:`lightning_pipe.models.huggingface.loss_items`), and the notice for a loss the strategy cannot count
(:mod:`lightning_pipe.step.token_mean`). Multi-process runs: tests/test_peft.py and tests/test_hf_heads.py."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.errors import PipelineUsageError
from lightning_pipe.models.huggingface.loss_items import counting, items_of
from lightning_pipe.step.token_mean import counted_items, uneven_ignored, uneven_ignored_message

transformers = pytest.importorskip("transformers")

from tests.hf_models import build  # noqa: E402

LABELS = torch.tensor([[5, 6, 7, -100, -100], [8, 9, -100, -100, -100]])


def _ids() -> torch.Tensor:
    return LABELS.clamp(min=1)


def test_a_causal_lm_loss_is_counted_after_the_shift():
    model = build("llama", True, layers=2)
    with counting(model) as seen:
        out = model(input_ids=_ids(), labels=LABELS)
    assert int(items_of(out.loss, seen)) == int((LABELS[:, 1:] != -100).sum()) == 3
    assert "_loss_function" not in model.__dict__  # the model's own loss function is back


def test_shift_labels_are_counted_as_given():
    model = build("llama", True, layers=2)
    shifted = torch.tensor([[5, -100, 7, -100, 1], [8, 9, -100, -100, -100]])
    with counting(model) as seen:
        out = model(input_ids=_ids(), labels=LABELS, shift_labels=shifted)
    assert int(items_of(out.loss, seen)) == 5


def test_a_token_classifier_loss_is_counted_without_shift():
    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_labels=3
    )
    model = transformers.LlamaForTokenClassification(config)
    labels = torch.tensor([[0, 2, 1, -100, -100], [1, -100, -100, -100, -100]])
    with counting(model) as seen:
        out = model(input_ids=_ids(), labels=labels)
    assert int(items_of(out.loss, seen)) == 4


def test_nothing_is_counted_when_the_call_passes_num_items_in_batch():
    model = build("llama", True, layers=2)
    with counting(model) as seen:
        out = model(input_ids=_ids(), labels=LABELS, num_items_in_batch=torch.tensor(10))
    assert seen == [] and items_of(out.loss, seen) is None


def test_a_loss_function_of_ones_own_is_not_counted_and_stays():
    model = build("llama", True, layers=2)

    def own(logits, labels, vocab_size, **kwargs):
        return logits.float().mean()

    model.loss_function = own
    with counting(model) as seen:
        out = model(input_ids=_ids(), labels=LABELS)
    assert seen == [] and items_of(out.loss, seen) is None
    assert model.loss_function is own


def test_a_value_computed_from_the_loss_is_not_counted():
    model = build("llama", True, layers=2)
    with counting(model) as seen:
        out = model(input_ids=_ids(), labels=LABELS)
    assert items_of(out.loss * 1, seen) is None


def test_a_sequence_classifier_is_not_counted():
    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_labels=3
    )
    model = transformers.LlamaForSequenceClassification(config)
    model.config.pad_token_id = 0
    with counting(model) as seen:
        model(input_ids=_ids(), labels=torch.tensor([0, 2]))
    assert seen == []


def test_counted_items_refuse_a_loss_counted_in_some_microbatches_only():
    with pytest.raises(PipelineUsageError, match=r"`training_step`.*microbatches \[1\].*`num_items`"):
        counted_items("training_step", [torch.tensor(3), None])
    assert counted_items("training_step", [None, None]) is None


def test_uneven_ignored_names_the_tensor_and_the_counts():
    batch = {
        "ids": torch.ones(4, 3, dtype=torch.long),
        "labels": torch.tensor([[1, -100], [-100, -100], [1, 2], [3, 4]]),
    }
    microbatches = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
    assert uneven_ignored(microbatches) == ("batch['labels']", [3, 0])
    assert (
        uneven_ignored([(torch.ones(2, 2), torch.full((2,), -100)), (torch.ones(2, 2), torch.full((2,), -100))]) is None
    )
    assert uneven_ignored(microbatches[:1]) is None


def test_uneven_ignored_message_names_the_tensor_the_counts_and_the_fix():
    message = uneven_ignored_message("training_step", "batch[2]", [3, 0])
    assert "`batch[2]`" in message and "[3, 0]" in message and "'num_items': (labels != -100).sum()" in message
