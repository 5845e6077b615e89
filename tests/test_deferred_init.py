"""Initialisation written any way on the meta device, recorded and replayed on each stage's own tensors
(lightning_pipe/split/deferred_init.py): the model's distribution, the same values in every layout, precise errors."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from lightning_pipe.errors import PipelineModelError
from lightning_pipe.models.units import find_layout
from lightning_pipe.split.deferred_init import record_init
from lightning_pipe.split.initialization import initialize
from lightning_pipe.split.partition import stage_units
from lightning_pipe.split.surgery import prune
from tests.gpt2 import GPT2Body, gpt2_init

CPU = torch.device("cpu")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(4)
        )
        self.head = nn.Linear(64, 100, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)
        self.rot = nn.Parameter(torch.empty(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _init_any_way(net: Net) -> None:
    net.apply(functools.partial(gpt2_init, n_layer=4))  # free function
    for name, p in net.named_parameters():  # loop of nn.init calls, including one torch skips on meta
        if name.endswith("3.weight"):
            nn.init.trunc_normal_(p, std=0.01)
    with torch.no_grad():
        net.blocks[0][0].weight.fill_(2.0)  # fill under no_grad
        net.blocks[1][1].weight[:, :4].zero_()  # in place on a slice
    net.head.weight.data.normal_(0.0, 0.05)  # through .data
    nn.init.orthogonal_(net.rot)  # QR of a temporary


def _build(init=_init_any_way):
    with torch.device("meta"), record_init() as recording:
        net = Net()
        init(net)
    return net, recording.finish(net)


def _initialised(counts=None, seed=3) -> dict[str, torch.Tensor]:
    net, recording = _build()
    if counts is not None:
        layout = find_layout(net, "blocks")
        keep = stage_units(layout, counts)[1]
        prune(net, keep, layout.units)
    assert initialize(net, CPU, seed, recording=recording) == "recorded"
    return {**dict(net.named_parameters()), **dict(net.named_buffers())}


def test_replayed_init_follows_the_model():
    state = _initialised()
    for name, value in state.items():
        if name.endswith("3.weight"):
            assert value.std().item() == pytest.approx(0.01, rel=0.1), name
        elif name.endswith("1.weight") or name == "emb.weight":
            assert value.std().item() == pytest.approx(0.02, rel=0.1), name
    assert torch.all(state["blocks.0.0.weight"] == 2.0) and torch.all(state["blocks.1.0.weight"] == 1.0)
    assert torch.all(state["blocks.1.1.weight"][:, :4] == 0) and state["blocks.1.1.weight"][:, 4:].std() > 0.015
    assert state["head.weight"].std().item() == pytest.approx(0.05, rel=0.1)
    torch.testing.assert_close(state["rot"].T @ state["rot"], torch.eye(8))
    torch.testing.assert_close(state["inv_freq"], torch.tensor([1.0, 0.1, 0.01, 0.001]))
    assert all(not torch.any(v) for k, v in state.items() if k.endswith("bias") and "blocks" in k and ".0." not in k)


def test_replayed_init_is_the_same_in_every_layout():
    whole = _initialised()
    for counts in ([1, 3], [2, 2], [3, 1]):
        for name, value in _initialised(counts).items():
            assert torch.equal(value, whole[name]), name
    assert not torch.equal(_initialised(seed=4)["head.weight"], whole["head.weight"])


def test_without_the_recording_a_free_function_init_is_lost():
    # What the strategy did before recording: PyTorch's defaults (Linear(32, 96): std 1/sqrt(3 * 32) ~ 0.10).
    with torch.device("meta"):
        net = GPT2Body()
        net.apply(gpt2_init)
    assert initialize(net, CPU, 0) == "reset_parameters"
    assert net.h[0].attn.c_attn.weight.std().item() > 0.05


def test_hooks_fill_what_the_recording_left_unset():
    class WithHook(Net):
        def _init_weights(self, module: nn.Module) -> None:
            if isinstance(module, WithHook):
                nn.init.constant_(module.rot, 0.5)
            elif isinstance(module, nn.Linear):
                nn.init.constant_(module.weight, 0.5)

    with torch.device("meta"), record_init() as recording:
        net = WithHook()  # Linear's reset_parameters runs (recorded as PyTorch's defaults); `rot` is left empty
        nn.init.normal_(net.blocks[0][1].weight, std=0.02)
    assert initialize(net, CPU, 0, recording=recording.finish(net)) == "_init_weights"
    assert net.blocks[0][1].weight.std().item() == pytest.approx(0.02, rel=0.1)  # recorded, kept
    assert torch.all(net.blocks[1][1].weight == 0.5)  # Linear's default init (recorded) yields to the model's hook
    assert torch.all(net.rot == 0.5)  # unset: the model's hook
    torch.testing.assert_close(net.inv_freq, torch.tensor([1.0, 0.1, 0.01, 0.001]))  # set: kept beside `rot`


class FromUnrecorded(nn.Module):
    """A buffer computed from a tensor whose meta creation no operator records (Gemma 3n's
    ``torch.rsqrt(torch.tensor(2.0))``), beside a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.rsqrt(torch.tensor(2.0)), persistent=False)


def test_a_value_computed_from_an_unrecorded_meta_tensor_is_left_to_the_hook():
    class WithHook(FromUnrecorded):
        def _init_weights(self, module: nn.Module) -> None:
            if isinstance(module, WithHook):
                nn.init.constant_(module.scale, 2.0**-0.5)

    with torch.device("meta"), record_init() as recording:
        net = WithHook()
    assert initialize(net, CPU, 0, recording=recording.finish(net)) == "_init_weights"
    assert net.scale.item() == pytest.approx(2.0**-0.5)


def test_a_value_computed_from_an_unrecorded_meta_tensor_without_a_hook_is_reported_missing():
    with torch.device("meta"), record_init() as recording:
        net = FromUnrecorded()
    with pytest.raises(PipelineModelError, match=r"Tensors \['scale'\]"):
        initialize(net, CPU, 0, recording=recording.finish(net))


def test_a_recorded_generator_draws_from_the_parameter_s_seed():
    def with_generator(net: Net) -> None:
        _init_any_way(net)
        nn.init.normal_(net.head.weight, std=0.02, generator=torch.Generator().manual_seed(123))

    first, second = (_build(with_generator) for _ in range(2))
    for net, recording in (first, second):
        initialize(net, CPU, 0, recording=recording)
    assert torch.equal(first[0].head.weight, second[0].head.weight)
    assert first[0].head.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_reading_another_parameter_is_refused_with_the_call():
    def copy_from_embedding(net: Net) -> None:
        _init_any_way(net)
        with torch.no_grad():
            net.head.weight.copy_(net.emb.weight)

    net, recording = _build(copy_from_embedding)
    with pytest.raises(
        PipelineModelError,
        match=r"initialisation of `head\.weight` in `configure_model` reads `emb\.weight` \(`copy_\.default` at"
        r" .*test_deferred_init\.py:\d+ \(copy_from_embedding\)\).*drawn at random \(`normal_.*tied weights",
    ):
        initialize(net, CPU, 0, recording=recording)


class Saved(Net):
    """The head and a trainable copy of it, as PEFT's ``modules_to_save`` keeps them (``copy.deepcopy``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks.append(nn.Sequential(nn.Linear(64, 64)))
        _init_any_way(self)
        self.blocks[4].append(copy.deepcopy(self.blocks[4][0]))  # copies what the init drew


def _saved() -> tuple[Saved, object]:
    with torch.device("meta"), record_init() as recording:
        net = Saved()
    return net, recording.finish(net)


def test_a_copy_of_a_parameter_drawn_at_random_takes_its_value():
    net, recording = _saved()
    initialize(net, CPU, 0, recording=recording)
    original, copied = net.blocks[4][0], net.blocks[4][1]
    assert original.weight.std().item() == pytest.approx(0.02, rel=0.2)  # gpt2_init's, not PyTorch's default
    assert torch.equal(copied.weight, original.weight) and torch.equal(copied.bias, original.bias)
    last, recording = _saved()
    last.emb, last.blocks[0] = None, None  # another stage's units gone: the same values
    initialize(last, CPU, 0, recording=recording)
    assert torch.equal(last.blocks[4][1].weight, original.weight)


def test_a_copy_whose_original_is_on_another_stage_is_refused():
    net, recording = _saved()
    net.blocks[4][0] = None  # the original pruned away, the copy kept
    with pytest.raises(
        PipelineModelError,
        match=r"`blocks\.4\.1\.weight` is initialised in `configure_model` as a copy of `blocks\.4\.0\.weight`"
        r".*drawn at random.*different pipeline stages"
        r".*Keep `blocks\.4\.1\.weight` and `blocks\.4\.0\.weight` in one unit",
    ):
        initialize(net, CPU, 0, recording=recording)


def test_a_copy_changed_by_its_original_afterwards_is_refused():
    with torch.device("meta"), record_init() as recording:
        net = Saved()
        net.blocks[4][0].weight.data.normal_()  # the copy keeps the value drawn before: not the original's final one
    with pytest.raises(
        PipelineModelError,
        match=r"initialisation of `blocks.4.1.weight` in `configure_model` reads `blocks.4.0.weight` \(`clone",
    ):
        initialize(net, CPU, 0, recording=recording.finish(net))


def test_a_view_into_a_larger_tensor_is_refused():
    class Views(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            both = torch.empty(8, 4)
            self.a, self.b = nn.Parameter(both[:4]), nn.Parameter(both[4:])

    with torch.device("meta"), record_init() as recording:
        net = Views()
        nn.init.normal_(net.b)
    with pytest.raises(
        PipelineModelError,
        match=r"`a` is a view.*larger tensor.*`configure_model`"
        r".*\(`normal_\.default` at .*test_deferred_init\.py:\d+.*tensor of its own",
    ):
        initialize(net, CPU, 0, recording=recording.finish(net))


def test_tied_parameters_replay_once_under_the_first_name():
    class Tied(GPT2Body):
        def __init__(self) -> None:
            super().__init__(n_layer=2)
            self.lm_head.weight = self.wte.weight

    def build() -> tuple[nn.Module, object]:
        with torch.device("meta"), record_init() as recording:
            net = Tied()
            net.apply(gpt2_init)
        return net, recording.finish(net)

    whole, recording = build()
    initialize(whole, CPU, 0, recording=recording)
    head_only, recording = build()
    head_only.wte = None  # a last stage holds the head only: same values, seeded by the first name (`wte.weight`)
    initialize(head_only, CPU, 0, recording=recording)
    assert torch.equal(head_only.lm_head.weight, whole.wte.weight)


def test_a_hugging_face_model_s_own_init_is_replayed():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4
    )
    with torch.device("meta"), record_init() as recording:
        net = transformers.LlamaForCausalLM(config)
    layout_counts = [2, 2]
    from lightning_pipe.models.huggingface.plan import hf_layout, hf_placeholder

    layout = hf_layout(net)
    prune(net, stage_units(layout, layout_counts)[1], layout.units, hf_placeholder(net))
    initialize(net, CPU, 0, units=layout.units, recording=recording.finish(net))
    for name, value in net.named_parameters():
        if value.dim() == 2:
            assert value.std().item() == pytest.approx(config.initializer_range, rel=0.15), name
        else:
            assert torch.all(value == 1), name
    rotary = net.model.rotary_emb
    expected = (
        1.0 / (config.rope_theta ** (torch.arange(0, 8, 2).float() / 8)) if hasattr(config, "rope_theta") else None
    )
    if expected is not None:
        torch.testing.assert_close(rotary.inv_freq, expected)
