"""The model's own init after a meta-device split: same weights in every layout, the model's distribution."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from lightning_pipe.errors import PipelineModelError
from lightning_pipe.models.units import find_layout
from lightning_pipe.split.initialization import (
    WHOLE_MODEL_WARN_BYTES,
    init_hook,
    initialize,
    unit_seed,
    warn_whole_model,
)
from lightning_pipe.split.partition import stage_units
from lightning_pipe.split.surgery import prune
from tests.gpt2 import GPT2
from tests.models import TinyLM
from tests.reference import materialize

CPU = torch.device("cpu")


def _gpt(**kwargs) -> GPT2:
    with torch.device("meta"):
        return GPT2(**kwargs)


def _stages(build, counts, seed=3, owner=None) -> list[dict[str, torch.Tensor]]:
    layout = find_layout(build())
    out = []
    for units in stage_units(layout, counts):
        model = build()
        prune(model, units, layout.units)
        initialize(model, CPU, seed, units=layout.units, owner=owner)
        out.append(dict(model.state_dict()))
    return out


@pytest.mark.parametrize("counts", [[2, 2], [1, 1, 1, 1], [3, 1]])
def test_gpt2_init_is_the_same_in_every_layout(counts):
    full = _stages(_gpt, [4])[0]
    pieces = _stages(_gpt, counts)
    assert sorted(k for piece in pieces for k in piece) == sorted(full)
    for piece in pieces:
        for name, value in piece.items():
            assert torch.equal(value, full[name]), name


def test_gpt2_init_follows_the_model_not_pytorch_defaults():
    model = _gpt(vocab=4096, block_size=64, n_layer=4, n_embd=256)
    assert initialize(model, CPU, seed=0, units=find_layout(model).units) == "_init_weights"
    residual = 0.02 / math.sqrt(2 * 4)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            assert p.std().item() == pytest.approx(residual, rel=0.05), name
        elif name.endswith("weight") and p.dim() == 2:
            assert p.std().item() == pytest.approx(0.02, rel=0.05), name
            assert p.mean().abs().item() < 0.002
        elif name.endswith("bias") and "ln" not in name:
            assert not p.any(), name
        elif name.startswith("ln") or ".ln_" in name:
            assert torch.equal(p, torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p)), name


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = _gpt(), _gpt(), _gpt()
    initialize(a, CPU, seed=1)
    initialize(b, CPU, seed=1)
    initialize(c, CPU, seed=2)
    assert torch.equal(a.h[0].attn.c_attn.weight, b.h[0].attn.c_attn.weight)
    assert not torch.equal(a.h[0].attn.c_attn.weight, c.h[0].attn.c_attn.weight)


def test_without_a_hook_it_is_materialize():
    with torch.device("meta"):
        a, b = TinyLM(n_layers=4), TinyLM(n_layers=4)
    assert init_hook(a) == "reset_parameters"
    initialize(a, CPU, seed=7)
    materialize(b, CPU, seed=7)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_lightning_module_hook_is_used_when_the_network_has_none():
    class Owner(nn.Module):
        def _init_weights(self, module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.constant_(module.weight, 0.5)

    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    assert initialize(net, CPU, seed=0, owner=Owner()) == "_init_weights"
    assert bool((net[0].weight == 0.5).all())
    # The hook left the biases alone: they get the owner's reset_parameters(), same seed as materialize's.
    with torch.device("meta"):
        ref = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    materialize(ref, CPU, seed=0)
    assert torch.equal(net[1].bias, ref[1].bias)


class _TitanBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 8))

    def init_weights(self) -> None:
        nn.init.trunc_normal_(self.w, std=0.5)


class _Titan(nn.Module):
    """torchtitan's pattern: a root ``init_weights`` that skips units other stages own."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(16, 8)
        self.layers = nn.ModuleDict({str(i): _TitanBlock() for i in range(4)})
        self.out = nn.Linear(8, 16, bias=False)
        self.register_buffer("freqs", torch.empty(4), persistent=False)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        self.freqs = torch.arange(4.0)
        if self.tok is not None:
            nn.init.normal_(self.tok.weight)
        for layer in self.layers.values():
            layer.init_weights()
        if self.out is not None:
            nn.init.trunc_normal_(self.out.weight, std=0.1, a=-0.3, b=0.3)


def test_torchtitan_style_init_weights_is_per_unit_and_layout_free():
    def build() -> _Titan:
        with torch.device("meta"):
            return _Titan()

    assert init_hook(build()) == "init_weights"
    full = _stages(build, [4])[0]
    for counts in ([2, 2], [1, 1, 1, 1]):
        for piece in _stages(build, counts):
            for name, value in piece.items():
                assert torch.equal(value, full[name]), name
    model = build()
    initialize(model, CPU, seed=0, units=find_layout(model).units)
    assert torch.equal(model.freqs, torch.arange(4.0))
    assert model.out.weight.abs().max() <= 0.3


def test_a_value_lost_on_meta_is_an_error():
    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))  # no reset_parameters: the 1s are lost on the meta device

    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(4, 4), Norm())
    with pytest.raises(
        PipelineModelError, match=r"Tensors \['1\.scale'\] .*meta device.*not set by.*init.*`_init_weights\(module\)`"
    ):
        initialize(net, CPU, seed=0)


def test_unit_seed_matches_materialize():
    import zlib

    assert unit_seed(5, "h.0") == (5 + zlib.crc32(b"h.0")) % 2**63


def test_whole_model_warning_names_bytes_configure_model_and_the_data_order():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_whole_model(300 * 2**20, 150 * 2**20)
    message = str(caught[0].message)
    assert "300.00 MiB" in message and "150.00 MiB" in message and "configure_model" in message
    assert "shuffling DataLoader's order" in message and "init_values='one_device'" in message  # no trade-off now


def test_whole_model_warning_only_where_the_memory_matters():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_whole_model(WHOLE_MODEL_WARN_BYTES - 1, 2**20)  # the 853 KiB GPT of the getting-started example, say
    assert caught == []


def test_hugging_face_llama_from_config():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )

    def build() -> nn.Module:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config)

    full = _stages(build, [4])[0]
    for counts in ([2, 2], [1, 1, 1, 1]):
        for piece in _stages(build, counts):
            for name, value in piece.items():
                assert torch.equal(value, full[name]), name
    model = build()
    initialize(model, CPU, seed=0, units=find_layout(model).units)
    assert model.model.layers[0].self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(model.model.norm.weight, torch.ones(32))
    eager = transformers.LlamaForCausalLM(config)
    assert torch.equal(model.model.rotary_emb.inv_freq, eager.model.rotary_emb.inv_freq)
