"""The model-kind layer (lightning_pipe.models): one protocol, one answer per question for every caller."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.errors import PipelineModelError
from lightning_pipe.models import KINDS, kind_of
from lightning_pipe.models.base import ModelKind
from lightning_pipe.models.plain import PlainKind, call_with_activation
from lightning_pipe.models.units import Layout

PROTOCOL = [
    name
    for name in dir(ModelKind)
    if not name.startswith("_") and name not in ("name", "stage_call", "prepare_dataflow_call", "prepare_profile_call")
]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_plain_module_is_a_plain_kind_with_nothing_of_its_own():
    net = _Net()
    kind = kind_of(net)
    assert isinstance(kind, PlainKind)
    assert kind.layout(net) == Layout(pre=("embed",), blocks=("blocks.0", "blocks.1", "blocks.2"), post=("head",))
    assert kind.stage_call is call_with_activation
    assert kind.placeholder(net) is None and kind.dataflow_order(net) is None
    assert kind.tensor_parallel_plan(net, 2) is None
    assert list(kind.disk_names(net, "blocks.0.weight")) == ["blocks.0.weight"]
    assert kind.record(net, "model") is None and kind.directory_type(net) is None
    assert not kind.restore_buffers(net.head)


def test_every_kind_implements_the_whole_protocol():
    assert PROTOCOL, "the protocol has methods"
    assert all(callable(getattr(PlainKind(), name)) for name in PROTOCOL)
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    hf = kind_of(transformers.LlamaForCausalLM(config))
    assert hf.name == "transformers LlamaForCausalLM"
    assert all(callable(getattr(hf, name)) for name in PROTOCOL)
    assert len(KINDS) >= 1


def test_a_kind_claims_before_the_plain_fallback(monkeypatch):
    class Mine:
        name = "mine"

    net = _Net()
    monkeypatch.setattr("lightning_pipe.models.KINDS", (lambda network: Mine() if network is net else None,))
    assert isinstance(kind_of(net), Mine)
    assert isinstance(kind_of(nn.Linear(2, 2)), PlainKind)


def _llama_with_misnamed_base():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    network = transformers.LlamaForCausalLM(config)
    # transformers 4.54's Gemma3ForCausalLM says `base_model_prefix = "language_model"` but keeps it in `model`.
    network.base_model_prefix = "language_model"
    return network


def test_one_base_prefix_for_the_pipeline_plan_the_tensor_parallel_plan_and_the_weights():
    from lightning_pipe.models.huggingface.plan import base_prefix, hf_layout
    from lightning_pipe.models.huggingface.tensor_parallel import full_plan

    network = _llama_with_misnamed_base()
    kind = kind_of(network)
    assert base_prefix(network) == "model"
    assert hf_layout(network).blocks[0] == "model.layers.0"
    # Before the layer, the tensor-parallel plan and the weight loader read `base_model_prefix` alone and named the
    # layers without "model.": they would have split and loaded nothing the pipeline plan holds.
    plan = full_plan(network)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["lm_head"] in (
        "colwise_rep",
        "colwise_gather_output",
    )
    assert list(kind.disk_names(network, "model.norm.weight")) == ["model.norm.weight", "norm.weight"]
    assert list(kind.disk_names(network, "norm.weight")) == ["norm.weight", "model.norm.weight"]


def test_a_base_model_has_no_base_prefix():
    from lightning_pipe.models.huggingface.plan import base_prefix

    base = _llama_with_misnamed_base().model
    assert base_prefix(base) == ""
    assert list(kind_of(base).disk_names(base, "norm.weight")) == ["norm.weight"]


def test_a_transformers_model_without_a_plan_is_refused_by_name():
    network = _llama_with_misnamed_base()
    network.config.base_model_pp_plan = None
    with pytest.raises(
        PipelineModelError, match=r"LlamaForCausalLM.*no pipeline plan.*`PipelineParallelStrategy\(model_plan="
    ):
        kind_of(network).layout(network)


def test_every_kind_class_answers_every_question_of_the_protocol():
    from lightning_pipe.models.huggingface.kind import HuggingFaceKind
    from lightning_pipe.models.litgpt import LitGPTKind
    from lightning_pipe.models.peft import PeftKind

    for cls in (PlainKind, HuggingFaceKind, PeftKind, LitGPTKind):
        names = (*PROTOCOL, "stage_call", "prepare_dataflow_call", "prepare_profile_call")
        missing = [name for name in names if not hasattr(cls, name)]
        assert missing == [], f"{cls.__name__} lacks {missing}"
