"""Token means without ``num_items``: the items a transformers model's own loss averages over, counted while it runs
(:mod:`lightning_pipe.models.huggingface.loss_items`), and the notice for a loss the strategy cannot count
(:mod:`lightning_pipe.step.token_mean`). Multi-process runs: tests/test_peft.py and tests/test_hf_heads.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_pipe.errors import PipelineUsageError
from lightning_pipe.models.huggingface.loss_items import counting, items_of, loss_candidates
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


def test_candidates_found_once_count_as_a_walk_of_the_model_does():
    model = build("llama", True, layers=2)
    candidates = loss_candidates(model)
    assert candidates == [model, model.model]  # the transformers models (whose own loss is told per call), no layer
    with counting(model, candidates) as seen:
        out = model(input_ids=_ids(), labels=LABELS)
    assert int(items_of(out.loss, seen)) == 3 and "_loss_function" not in model.__dict__
    assert loss_candidates(torch.nn.Linear(2, 2)) == []


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


# ------------------------------------------------------------------------------------------------ one process
# One process, one stage, 4 microbatches of 2 rows: the microbatch means and their weighting as under any pipeline
# (the 2-process runs: tests/test_peft.py, tests/test_hf_heads.py).
@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    from tests.hf_pretrained import save_pretrained

    return save_pretrained(tmp_path_factory.mktemp("token_mean") / "llama", "llama", False, layers=4, seed=3)


def _pipelined(directory, **kwargs):
    from lightning_pipe import PipelineParallelStrategy
    from tests.peft_models import fine_tune

    strategy = PipelineParallelStrategy(schedule="GPipe", microbatches=4, init_weights=directory)
    return fine_tune(directory, "lora", strategy, bare=True, **kwargs)


@pytest.mark.slow
def test_a_lora_fine_tune_returning_the_models_own_loss_equals_one_device(directory):
    from tests.peft_models import fine_tune

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model, _, val = _pipelined(directory)
    assert not [w for w in said if "num_items" in str(w.message)]  # counted: nothing to say
    reference, _, reference_val = fine_tune(directory, "lora", start=model.initial, bare=True)
    torch.testing.assert_close(model.step_losses, reference.step_losses, rtol=1e-5, atol=0)
    assert val == pytest.approx(reference_val, rel=1e-5)  # logged only (`self.log("val_loss", loss)`)
    for name, value in reference.named_parameters():
        if value.requires_grad:
            torch.testing.assert_close(model.get_parameter(name), value, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_loss_the_strategy_cannot_count_is_noticed_once(directory, monkeypatch):
    from tests.peft_models import LitPeft

    def scaled(self, batch, batch_idx):  # a value computed from the model's loss: not the model's own token mean
        ids, mask, labels = batch
        return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss * 1.0

    monkeypatch.setattr(LitPeft, "training_step", scaled)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _pipelined(directory)
    notices = [str(w.message) for w in said if "`num_items`" in str(w.message)]
    assert len(notices) == 1, notices
    assert "`training_step`" in notices[0] and "`batch[2]`" in notices[0] and "'num_items'" in notices[0]


@pytest.mark.slow
def test_a_token_classifier_returning_the_models_own_loss_equals_one_device(tmp_path):
    from lightning_pipe import PipelineParallelStrategy
    from tests.hf_heads import fine_tune, save_pretrained

    directory = save_pretrained(tmp_path / "tagger", "tagger", seed=2)
    strategy = PipelineParallelStrategy(schedule="GPipe", microbatches=4, init_weights=directory)
    model, _ = fine_tune(directory, "tagger", strategy, bare=True)
    reference, _ = fine_tune(directory, "tagger", bare=True)
    torch.testing.assert_close(model.step_losses, reference.step_losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(model.val_losses, reference.val_losses, rtol=1e-5, atol=0)


# ------------------------------------------------------------------------------------------------ litgpt, Fabric
def _sft_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets as litgpt's SFT collate makes them: each row's prompt (of its own length) and its padding
    masked with -100."""
    from tests.fabric_loop import BLOCK, VOCAB

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (8, BLOCK), generator=g)
    positions = torch.arange(BLOCK)
    prompt = torch.randint(1, BLOCK // 2, (8, 1), generator=g)
    end = torch.randint(BLOCK // 2 + 1, BLOCK + 1, (8, 1), generator=g)
    targets = torch.where((positions >= prompt) & (positions < end), ids, torch.full_like(ids, -100))
    return ids, targets


@pytest.mark.slow
def test_docs_litgpt_step_returns_num_items_and_without_it_the_notice_fires():
    pytest.importorskip("litgpt")
    from lightning.fabric import Fabric
    from litgpt.utils import chunked_cross_entropy

    from lightning_pipe import PipelineFabricStrategy
    from tests.fabric_loop import build_litgpt

    def loss_of(model, batch):
        input_ids, targets = batch
        logits = model(input_ids, lm_head_chunk_size=4)
        logits[-1] = logits[-1][..., :-1, :]
        return chunked_cross_entropy(logits, targets[..., 1:])

    def as_docs(model):  # docs/fabric.md's step function
        return lambda batch: {"loss": loss_of(model, batch), "num_items": (batch[1][..., 1:] != -100).sum()}

    batch = _sft_batch()
    one = Fabric(accelerator="cpu", devices=1)
    one.seed_everything(0)
    reference = build_litgpt(one)
    expected = loss_of(reference, batch)
    expected.backward()
    expected_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    fabric = Fabric(strategy=PipelineFabricStrategy(frontend="dataflow", microbatches=4), accelerator="cpu", devices=1)
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup_module(build_litgpt(fabric))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        weighted = model.step(as_docs(model), batch)
        fabric.backward(weighted)
    assert not [w for w in said if "`num_items`" in str(w.message)]
    assert float(weighted) == pytest.approx(float(expected), rel=1e-6)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert float(norm) == pytest.approx(float(expected_norm), rel=1e-5)
    model.zero_grad()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        bare = model.step(lambda b: loss_of(model, b), batch)
        fabric.backward(bare)
    notices = [str(w.message) for w in said if "`num_items`" in str(w.message)]
    assert len(notices) == 1 and "`the step function`" in notices[0] and "`batch[1]`" in notices[0], notices
    assert float(bare) != pytest.approx(float(expected), rel=1e-6)  # the mean of the microbatch means
