"""Unmodified transformers causal LMs split into stages in one process give the unsplit model's loss, logits and
gradients: one pruned deep copy per stage, chained through ``hf_stage_call`` as the pipeline chains them."""

from __future__ import annotations

import copy

import pytest
import torch
from packaging.version import Version
from torch import nn

transformers = pytest.importorskip("transformers")

from lightning_pipe.errors import PipelineModelError, PipelineUsageError  # noqa: E402
from lightning_pipe.split import hf  # noqa: E402
from lightning_pipe.split.hf import PassThrough, hf_layout, hf_placeholder, hf_stage_call, is_hf_model  # noqa: E402
from lightning_pipe.split.partition import balance_blocks, stage_units  # noqa: E402
from lightning_pipe.split.surgery import prune, stage_view  # noqa: E402
from lightning_pipe.split.tied import tied_groups  # noqa: E402

VOCAB = 61
SEQ = 9
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attn_implementation="eager",
)


def _llama(tie: bool = False) -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, tie_word_embeddings=tie))


def _qwen2() -> nn.Module:
    # Two sliding-window layers after two full ones: a stage holding layers 2-3 must still give them the sliding
    # mask, which Qwen2 picks by each layer's position in the list (`config.layer_types[i]`).
    config = transformers.Qwen2Config(
        **SMALL, use_sliding_window=True, sliding_window=3, max_window_layers=2, tie_word_embeddings=False
    )
    assert config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    return transformers.Qwen2ForCausalLM(config)


def _mistral() -> nn.Module:
    return transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=3))


FAMILIES = {
    "llama-untied": lambda: _llama(tie=False),
    "llama-tied": lambda: _llama(tie=True),
    "qwen2-sliding": _qwen2,
    "mistral-sliding": _mistral,
}


def _batch(padding: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (3, SEQ), generator=g)
    attention_mask = torch.ones(3, SEQ, dtype=torch.long)
    for row, n_pad in enumerate((3, 0, 5)):
        if padding == "right":
            attention_mask[row, SEQ - n_pad :] = 0
        else:
            attention_mask[row, :n_pad] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def _stages(network: nn.Module, num_stages: int) -> list[nn.Module]:
    layout = hf_layout(network)
    units = stage_units(layout, balance_blocks(len(layout.blocks), num_stages))
    placeholder = hf_placeholder(network)
    return [prune(copy.deepcopy(network), keep, layout.units, placeholder) for keep in units]


def _run_pipeline(stages: list[nn.Module], args: tuple, kwargs: dict) -> tuple[object, list[torch.Tensor]]:
    """Forward through the stages with a detached activation between them, then backward stage by stage, as torch's
    pipeline does; returns the last stage's output and the activations sent."""
    sent: list[torch.Tensor] = []
    received = None
    outputs = []
    for i, stage in enumerate(stages):
        out = hf_stage_call(stage, args, kwargs, received, i == 0, i == len(stages) - 1)
        outputs.append(out)
        if i < len(stages) - 1:
            assert isinstance(out, torch.Tensor)
            sent.append(out)
            received = (out.detach().requires_grad_(True),)
            outputs.append(received[0])
    last = outputs[-1]
    last.loss.backward()
    # outputs: [out0, recv1, out1, recv2, ..., out_last]; each sent activation gets its receiver's gradient.
    for k in range(len(stages) - 2, -1, -1):
        out, recv = outputs[2 * k], outputs[2 * k + 1]
        out.backward(recv.grad)
    return last, sent


def _summed_grads(full: nn.Module, stages: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Each parameter's gradient summed over the stages holding a copy, under the unsplit model's name."""
    canonical = {name: group[0] for group in tied_groups(full) for name in group}
    grads: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, param in stage.named_parameters():
            if param.grad is not None:
                key = canonical.get(name, name)
                grads[key] = grads[key] + param.grad if key in grads else param.grad.clone()
    return grads


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_split_matches_unsplit_model(family, padding):
    torch.manual_seed(0)
    full = FAMILIES[family]()
    kwargs = _batch(padding)
    expected = full(**kwargs)
    expected.loss.backward()
    for num_stages in (2, 3, 4):
        stages = _stages(full, num_stages)
        for stage in stages:
            stage.zero_grad(set_to_none=True)
        out, sent = _run_pipeline(stages, (), kwargs)
        assert type(out) is type(expected)
        assert all(a.dtype == torch.float32 and a.shape == (3, SEQ, 32) for a in sent)
        torch.testing.assert_close(out.loss, expected.loss)
        torch.testing.assert_close(out.logits, expected.logits)
        grads = _summed_grads(full, stages)
        assert set(grads) == {name for name, _ in full.named_parameters()}
        for name, param in full.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, msg=f"{family}, {num_stages} stages: {name}")


def test_gradient_checkpointing_matches():
    # transformers' checkpointing recomputes blocks in backward, after the stage call's hooks are gone.
    torch.manual_seed(0)
    full = _qwen2()
    full.gradient_checkpointing_enable()
    kwargs = _batch("left")
    expected = full(**kwargs)
    expected.loss.backward()
    stages = _stages(full, 3)
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    out, _ = _run_pipeline(stages, (), kwargs)
    torch.testing.assert_close(out.loss, expected.loss)
    grads = _summed_grads(full, stages)
    for name, param in full.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, msg=name)


def test_views_of_one_model_share_its_parameters_and_match():
    # The rank's module is pruned in place and each stage gets a view; here one module holds all stages.
    torch.manual_seed(0)
    network = _llama(tie=True)
    reference = copy.deepcopy(network)
    kwargs = _batch("left")
    expected = reference(**kwargs)
    expected.loss.backward()
    layout = hf_layout(network)
    units = stage_units(layout, [1, 2, 1])
    placeholder = hf_placeholder(network)
    views = [stage_view(network, keep, layout.units, placeholder) for keep in units]
    out, _ = _run_pipeline(views, (), kwargs)
    torch.testing.assert_close(out.logits, expected.logits)
    assert network.lm_head.weight is network.model.embed_tokens.weight  # views did not touch the module
    for (name, param), (_, ref) in zip(network.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(param.grad, ref.grad, msg=name)


def test_positional_input_ids_and_bfloat16_activations():
    torch.manual_seed(0)
    full = _llama().to(torch.bfloat16)
    kwargs = _batch("right")
    input_ids = kwargs.pop("input_ids")
    expected = full(input_ids, **kwargs)
    stages = _stages(full, 2)
    hidden = hf_stage_call(stages[0], (input_ids,), kwargs, None, True, False)
    assert hidden.dtype == torch.bfloat16
    out = hf_stage_call(stages[1], (input_ids,), kwargs, (hidden,), False, True)
    assert out.logits.dtype == expected.logits.dtype
    torch.testing.assert_close(out.loss, expected.loss)
    torch.testing.assert_close(out.logits, expected.logits)


def test_first_stage_from_inputs_embeds():
    torch.manual_seed(0)
    full = _llama()
    kwargs = _batch("right")
    kwargs["inputs_embeds"] = full.model.embed_tokens(kwargs.pop("input_ids")).detach()
    expected = full(**kwargs)
    stages = _stages(full, 2)
    hidden = hf_stage_call(stages[0], (), kwargs, None, True, False)
    out = hf_stage_call(stages[1], (), kwargs, (hidden,), False, True)
    torch.testing.assert_close(out.logits, expected.logits)


def test_layout_from_the_pipeline_plan():
    network = _llama(tie=True)
    layout = hf_layout(network)
    assert layout.pre == ("model.embed_tokens",)
    assert layout.blocks == tuple(f"model.layers.{i}" for i in range(4))
    assert layout.post == ("model.norm", "lm_head")  # the base model's plan first, the head after it
    assert "model.rotary_emb" not in layout.units  # no parameters: stays on every stage
    assert is_hf_model(network) and not is_hf_model(nn.Linear(2, 2))


def test_placeholders_pass_blocks_and_norm_through_and_drop_embedding_and_head():
    placeholder = hf_placeholder(_llama())
    assert isinstance(placeholder("model.layers.2"), PassThrough)
    assert isinstance(placeholder("model.norm"), PassThrough)
    assert placeholder("model.embed_tokens") is None
    assert placeholder("lm_head") is None
    x = torch.randn(2, 3)
    assert placeholder("model.layers.0")(x, attention_mask=None) is x
    assert placeholder("model.norm")(hidden_states=x) is x
    assert not list(placeholder("model.layers.3").parameters())
    # transformers 4.x Qwen2 reads `decoder_layer.attention_type` from every block, placeholders included.
    qwen2 = _qwen2()
    stand_in = hf_placeholder(qwen2)("model.layers.3")
    assert stand_in.hidden_size == 32
    assert getattr(stand_in, "attention_type", None) == getattr(qwen2.model.layers[3], "attention_type", None)


def test_stage_holds_only_its_parameters_under_full_names():
    network = _llama(tie=True)
    first, middle, last = _stages(network, 3)
    assert {n for n, _ in first.named_parameters()} >= {
        "model.embed_tokens.weight",
        "model.layers.0.mlp.up_proj.weight",
    }
    assert {n.split(".")[2] for n, _ in middle.named_parameters()} == {"2"}
    assert last.model.embed_tokens is None and last.lm_head.weight.shape == (VOCAB, 32)
    assert "lm_head.weight" in dict(last.named_parameters())


def test_tied_groups():
    assert tied_groups(_llama(tie=True)) == [["model.embed_tokens.weight", "lm_head.weight"]]
    assert tied_groups(_llama(tie=False)) == []
    shared = nn.Linear(2, 2)
    inner = nn.Sequential(shared, shared)  # shared inside one unit: one stage, nothing to sum
    network = nn.Sequential(nn.Sequential(inner), nn.Linear(2, 2))
    assert tied_groups(network) == [["0.0.0.weight", "0.0.1.weight"], ["0.0.0.bias", "0.0.1.bias"]]
    assert tied_groups(network, units=["0", "1"]) == []


def test_refuses_model_without_pipeline_plan():
    network = _llama()
    network.config.base_model_pp_plan = None
    with pytest.raises(
        PipelineModelError, match=r"LlamaForCausalLM has no pipeline plan.*set `config.base_model_pp_plan`"
    ):
        hf_layout(network)
    if transformers.GPT2Config.base_model_pp_plan is None:  # GPT-2 has none up to transformers 5.23 at least
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB))
        with pytest.raises(PipelineModelError, match=r"GPT2LMHeadModel has no pipeline plan"):
            hf_layout(gpt2)


def test_refuses_parameters_outside_the_plan():
    config = transformers.LlamaConfig(**SMALL, num_labels=3)
    network = transformers.LlamaForSequenceClassification(config)
    with pytest.raises(PipelineModelError, match=r"Parameter 'score.weight' of LlamaForSequenceClassification"):
        hf_layout(network)


def test_refuses_old_transformers(monkeypatch):
    monkeypatch.setattr(hf, "MIN_TRANSFORMERS", "99.1")
    installed = transformers.__version__
    with pytest.raises(PipelineModelError, match=rf"transformers {installed} is installed.*transformers>=99.1"):
        hf_layout(_llama())


@pytest.mark.parametrize(
    "extra, match",
    [
        (dict(output_hidden_states=True), "output_hidden_states=True"),
        (dict(past_key_values=object()), "past_key_values"),
    ],
)
def test_refuses_calls_a_stage_cannot_answer(extra, match):
    stages = _stages(_llama(), 2)
    with pytest.raises(PipelineUsageError, match=match):
        hf_stage_call(stages[0], (), {**_batch("right"), **extra}, None, True, False)


def test_refuses_forward_that_changes_inputs_embeds_before_the_blocks():
    # Gemma before transformers 5.x scaled `inputs_embeds` in the base forward: every later stage would scale again.
    torch.manual_seed(0)
    stages = _stages(_llama(), 2)
    base = stages[1].model
    original = type(base).forward

    def scaling_forward(*args, inputs_embeds=None, **kwargs):
        return original(base, *args, inputs_embeds=inputs_embeds * 2.0, **kwargs)

    base.forward = scaling_forward
    kwargs = _batch("right")
    hidden = hf_stage_call(stages[0], (), kwargs, None, True, False)
    with pytest.raises(PipelineModelError, match=r"does not pass `inputs_embeds` unchanged to its first block"):
        hf_stage_call(stages[1], (), kwargs, (hidden,), False, True)


def test_gemma_is_exact_or_refused():
    # Gemma scales `inputs_embeds` in its base forward before transformers 5.4 and in its embedding from 5.4 on: the
    # split must then match exactly, and before that refuse rather than scale again on every stage.
    torch.manual_seed(0)
    full = transformers.GemmaForCausalLM(transformers.GemmaConfig(**SMALL, head_dim=8))
    kwargs = _batch("left")
    expected = full(**kwargs)
    stages = _stages(full, 2)
    hidden = hf_stage_call(stages[0], (), kwargs, None, True, False)
    scaled_in_forward = Version(transformers.__version__) < Version("5.4")
    if scaled_in_forward:
        with pytest.raises(PipelineModelError, match=r"GemmaForCausalLM does not pass `inputs_embeds` unchanged"):
            hf_stage_call(stages[1], (), kwargs, (hidden,), False, True)
    else:
        out = hf_stage_call(stages[1], (), kwargs, (hidden,), False, True)
        torch.testing.assert_close(out.logits, expected.logits)


def test_refuses_forward_that_changes_hidden_states_after_the_last_block():
    stages = _stages(_llama(), 2)
    stages[0].model.norm = nn.Dropout(p=0.5)  # not a pass-through: training-mode dropout makes a new tensor
    with pytest.raises(PipelineModelError, match=r"LlamaModel does not return its last block's output \(Tensor\)"):
        hf_stage_call(stages[0], (), _batch("right"), None, True, False)


def test_refuses_stage_pruned_without_placeholders():
    network = _llama()
    layout = hf_layout(network)
    stage = prune(copy.deepcopy(network), stage_units(layout, [2, 2])[1], layout.units, hf_placeholder(network))
    del stage.model.layers._modules["0"]  # block 2 would run at position 1
    with pytest.raises(
        PipelineModelError, match=r"holds blocks \['1', '2', '3'\] of its block list and nothing in place"
    ):
        hf_stage_call(stage, (), _batch("right"), (torch.zeros(3, SEQ, 32),), False, True)
