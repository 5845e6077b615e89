"""Unmodified transformers causal LMs split into stages in one process give the unsplit model's loss, logits and
gradients: one pruned deep copy per stage, chained through ``hf_stage_call`` as the pipeline chains them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from lightning_pipe.errors import PipelineModelError, PipelineUsageError  # noqa: E402
from lightning_pipe.models.huggingface import plan as hf  # noqa: E402
from lightning_pipe.models.huggingface.plan import (  # noqa: E402
    AbsentInput,
    AbsentOutput,
    PassThrough,
    hf_layout,
    hf_placeholder,
    is_hf_model,
)
from lightning_pipe.models.huggingface.stage import hf_stage_call  # noqa: E402
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


def test_placeholders_pass_blocks_through_stand_in_for_the_embedding_and_drop_norm_and_head():
    placeholder = hf_placeholder(_llama())
    assert isinstance(placeholder("model.layers.2"), PassThrough)
    assert isinstance(placeholder("model.embed_tokens"), AbsentInput)
    assert isinstance(placeholder("model.norm"), AbsentOutput)
    assert isinstance(placeholder("lm_head"), AbsentOutput)
    x = torch.randn(2, 3)
    assert placeholder("model.layers.0")(x, attention_mask=None) is x
    assert not list(placeholder("model.layers.3").parameters())
    assert not list(placeholder("model.embed_tokens").parameters())
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
    assert isinstance(last.model.embed_tokens, AbsentInput) and last.lm_head.weight.shape == (VOCAB, 32)
    assert isinstance(first.lm_head, AbsentOutput)
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
        PipelineModelError,
        match=r"LlamaForCausalLM.*no pipeline plan.*`LlamaConfig\.base_model_pp_plan`"
        r".*`PipelineParallelStrategy\(model_plan=",
    ):
        hf_layout(network)
    if transformers.GPT2Config.base_model_pp_plan is None:  # GPT-2 has none up to transformers 5.23 at least
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB))
        with pytest.raises(PipelineModelError, match=r"GPT2LMHeadModel has no pipeline plan"):
            hf_layout(gpt2)


def test_refuses_parameters_outside_the_plan():
    network = _llama()
    network.value_head = nn.Linear(8, 1)  # a head the forward does not call, outside the plan
    with pytest.raises(PipelineModelError, match=r"Parameter 'value_head.weight' of LlamaForCausalLM"):
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


def _two_stage_run(full: nn.Module, padding: str = "left"):
    kwargs = _batch(padding)
    stages = _stages(full, 2)
    hidden = hf_stage_call(stages[0], (), kwargs, None, True, False)
    return stages, kwargs, hidden


def test_a_forward_that_scales_inputs_embeds_is_exact():
    # The embedding stand-in's zeros take the scale on later stages; the first block gets the received states.
    torch.manual_seed(0)
    full = _llama()
    kwargs = _batch("right")
    original = type(full.model).forward

    def scaling_forward(self, *args, inputs_embeds=None, input_ids=None, **kw):
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return original(self, *args, inputs_embeds=embeds * 2.0, **kw)

    type(full.model).forward = scaling_forward
    try:
        expected = full(**kwargs)
        stages, kwargs, hidden = _two_stage_run(full, "right")
        out = hf_stage_call(stages[1], (), kwargs, (hidden,), False, True)
    finally:
        type(full.model).forward = original
    torch.testing.assert_close(out.logits, expected.logits)


@pytest.mark.parametrize("family", ["gemma", "granite"])
def test_families_that_scale_the_embeddings_are_exact(family):
    # Gemma multiplies by sqrt(hidden_size) (in the forward before transformers 5.4, in the embedding after), Granite
    # by `embedding_multiplier` (in the forward): both were refused before stages entered at their first block.
    torch.manual_seed(0)
    config_class = {"gemma": transformers.GemmaConfig, "granite": transformers.GraniteConfig}[family]
    model_class = {"gemma": transformers.GemmaForCausalLM, "granite": transformers.GraniteForCausalLM}[family]
    extra = {"gemma": dict(head_dim=8), "granite": dict(embedding_multiplier=3.0)}[family]
    full = model_class(config_class(**SMALL, **extra))
    expected = full(**_batch("left"))
    for num_stages in (2, 4):
        out, _ = _run_pipeline(_stages(full, num_stages), (), _batch("left"))
        torch.testing.assert_close(out.logits, expected.logits)


def test_a_stage_sends_what_the_next_block_receives():
    # Stage 0 leaves at block 2's input: the final norm (on every stage when it has no parameters, as OLMo's) never
    # runs before the last stage.
    stages = _stages(_llama(), 2)
    seen = []
    stages[0].model.layers[1].register_forward_hook(lambda module, args, out: seen.append(out))
    stages[0].model.norm = nn.Dropout(p=0.5)  # would change the activation if it ran
    hidden = hf_stage_call(stages[0], (), _batch("right"), None, True, False)
    assert hidden is seen[-1]


def test_stand_ins_hand_the_first_block_the_received_states():
    stages, kwargs, hidden = _two_stage_run(_llama())
    received = hidden.detach().requires_grad_(True)
    seen = []
    stages[1].model.layers[2].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    hf_stage_call(stages[1], (), kwargs, (received,), False, True)
    assert seen[0] is received
    assert stages[1].__dict__["_lightning_pipe_block_output"] == "tensor"


def test_refuses_a_forward_that_changes_the_hidden_states_between_blocks():
    stages, kwargs, hidden = _two_stage_run(_llama())

    def scale(module, args, output):
        return (output[0] * 2.0, *output[1:]) if isinstance(output, tuple) else output * 2.0

    # The forward changes block 1's output before block 2 takes it. (A hook of block 2's own counts as part of the
    # block: the stage's check runs ahead of it, as ahead of FSDP's.) A forward hook on block 1 registered while the
    # forward runs comes after the stage's own hook there, which hands on the received hidden states.
    def scale_once(module, args):
        handle = module.register_forward_hook(lambda m, a, out: (handle.remove(), scale(m, a, out))[1])

    stages[1].model.layers[1].register_forward_pre_hook(scale_once)
    with pytest.raises(
        PipelineModelError,
        match=r"LlamaForCausalLM does not hand.*block 2.*previous block's output.*another model family",
    ):
        hf_stage_call(stages[1], (), kwargs, (hidden,), False, True)


def test_refuses_a_forward_that_gives_the_blocks_values_of_the_embeddings():
    # E.g. position embeddings computed from the embedding's values: a later stage would compute them from zeros.
    stages, kwargs, hidden = _two_stage_run(_llama())
    rotary = stages[1].model.rotary_emb
    original = rotary.forward

    def from_values(x, position_ids):
        cos, sin = original(x, position_ids)
        return cos + x.sum() * 0, sin

    rotary.forward = from_values
    with pytest.raises(
        PipelineModelError,
        match=r"LlamaForCausalLM gives its blocks.*computed from the embeddings \(\w+ inside a block\)"
        r".*another model family",
    ):
        hf_stage_call(stages[1], (), kwargs, (hidden,), False, True)


def test_refuses_a_forward_that_stops_before_the_next_stage():
    stages, kwargs, _ = _two_stage_run(_llama())
    stages[0].config.num_hidden_layers = 2  # the forward runs `self.layers[: num_hidden_layers]`
    with pytest.raises(
        PipelineModelError,
        match=r"reached `model\.norm`.*last pipeline stage.*next stage's first block.*`config\.num_hidden_layers`",
    ):
        hf_stage_call(stages[0], (), kwargs, None, True, False)


def test_embedding_stand_in_outside_a_stage_call():
    stand_in = hf_placeholder(_llama())("model.embed_tokens")
    with pytest.raises(
        PipelineModelError, match=r"`model\.embed_tokens` belongs to another.*stage.*called outside.*pipeline strategy"
    ):
        stand_in(torch.zeros(2, 3, dtype=torch.long))


def test_refuses_unsupported_family_by_name():
    network = _llama()
    network.config.model_type = "hrm_text"
    with pytest.raises(
        PipelineModelError,
        match=r"LlamaForCausalLM \(model_type 'hrm_text'\) cannot be pipelined.*block stacks.*several times"
        r".*another strategy",
    ):
        hf_layout(network)


def test_refuses_a_plan_naming_modules_the_model_lacks():
    network = _llama()
    network.config.base_model_pp_plan = {"embed_tokens": (["input_ids"], ["inputs_embeds"]), "blocks": ([], [])}
    with pytest.raises(
        PipelineModelError,
        match=r"plan of LlamaForCausalLM names \['embed_tokens', 'blocks'\].*does not have"
        r".*`config\.base_model_pp_plan`",
    ):
        hf_layout(network)


def test_base_model_found_when_the_prefix_names_another_attribute():
    # transformers 4.54's Gemma3ForCausalLM says `base_model_prefix = "language_model"` but keeps it in `model`.
    network = _llama()
    network.base_model_prefix = "language_model"
    assert hf_layout(network).blocks[0] == "model.layers.0"


def test_refuses_stage_pruned_without_placeholders():
    network = _llama()
    layout = hf_layout(network)
    stage = prune(copy.deepcopy(network), stage_units(layout, [2, 2])[1], layout.units, hf_placeholder(network))
    del stage.model.layers._modules["0"]  # block 2 would run at position 1
    with pytest.raises(
        PipelineModelError,
        match=r"LlamaForCausalLM holds blocks \['1', '2', '3'\].*nothing in place"
        r".*`placeholder=hf_placeholder\(network\)`",
    ):
        hf_stage_call(stage, (), _batch("right"), (torch.zeros(3, SEQ, 32),), False, True)


def test_refuses_a_forward_that_returns_before_the_next_stage():
    base = _llama().model  # a base model: its forward can end without reaching a unit of the last stage
    stages = _stages(base, 2)
    stages[0].norm = nn.Identity()
    stages[0].config.num_hidden_layers = 2
    with pytest.raises(
        PipelineModelError, match=r"LlamaModel returned without calling.*next stage's first block.*every block"
    ):
        hf_stage_call(stages[0], (), {"input_ids": _batch("right")["input_ids"]}, None, True, False)


def test_tuner_profiles_a_transformers_model_as_its_stages_call_it():
    # The tuner (and `balance="auto"`) times each unit alone, calling it several times. The user's call leaves
    # `use_cache` at the config's True, so the blocks were handed one cache that grew by a microbatch on every timed
    # call (the Llama's tuner stopped at "size of tensor a (64) must match ... b (32)"). Stages call with
    # `use_cache=False`, and so does the profiler now.
    from lightning_pipe.settings import PipelineSettings
    from lightning_pipe.tune.profile import profile_network
    from tests.hf_models import LitHF, padded_batches

    model = LitHF(layers=2)
    assert model.model.config.use_cache
    batch = padded_batches(8, 0, "right").tensors
    profile = profile_network(model, PipelineSettings(), batch, [2, 4], torch.device("cpu"), repeats=2)
    assert sorted(profile.times) == [2, 4]
    for size in (2, 4):
        block = profile.times[size]["model.layers.0"]
        assert block.forward > 0 and block.backward > 0 and block.output_bytes == size * 9 * 32 * 4  # hidden states
