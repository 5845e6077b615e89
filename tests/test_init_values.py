"""``init_values="one_device"``: a network built on the meta device gets, on each rank's own stages, the values one
device draws with the same seed, and the global random stream ends where one device's ends
(lightning_pipe/split/deferred_init.py, ``InitRecording.replay_in_order``). Single process: the rank's share is
kept by pruning; the multi-process runs are in tests/test_hf_pipeline.py and tests/test_peft.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe import PipelineParallelStrategy
from lightning_pipe.compat.transformers import init_on_meta
from lightning_pipe.errors import PipelineConfigError, PipelineModelError
from lightning_pipe.models.units import find_layout
from lightning_pipe.split.deferred_init import record_init
from lightning_pipe.split.initialization import initialize
from lightning_pipe.split.partition import stage_units
from lightning_pipe.split.surgery import prune
from tests.test_deferred_init import Net, _init_any_way

CPU = torch.device("cpu")


def _one_device(build, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """What one device holds after building eagerly from ``seed``, and the next numbers its stream draws."""
    torch.manual_seed(seed)
    net = build()
    return dict(net.state_dict(keep_vars=False)), torch.rand(4)


def _stage(build, keep, seed: int = 0, init_values: str = "one_device", loaded=frozenset(), device=CPU):
    """A rank's share: built on the meta device from ``seed``, pruned to the units ``keep(net)``, initialised on
    ``device``; and the next numbers ``device``'s stream draws."""
    torch.manual_seed(seed)
    with torch.device("meta"), init_on_meta(), record_init(device) as recording:  # as the strategy's meta_init
        net = build()
    recording = recording.finish(net)
    keep(net)
    torch.manual_seed(1234)  # what runs between configure_model and the cut draws from the stream too
    initialize(net, device, seed, recording=recording, init_values=init_values, loaded=loaded)
    return net, torch.rand(4, device=device)


def _net() -> Net:
    net = Net()
    _init_any_way(net)  # apply(fn), trunc_normal_, orthogonal_, a slice, .data: each draws from the global stream
    return net


def _keep_stage(counts, stage):
    def keep(net: nn.Module) -> None:
        layout = find_layout(net, "blocks")
        prune(net, stage_units(layout, counts)[stage], layout.units)

    return keep


@pytest.mark.parametrize(("counts", "stage"), [([1, 3], 0), ([1, 3], 1), ([2, 2], 1), ([3, 1], 0)])
def test_each_stage_holds_one_device_s_values_and_the_stream_ends_there(counts, stage):
    whole, after = _one_device(_net)
    net, drawn = _stage(_net, _keep_stage(counts, stage))
    assert torch.equal(drawn, after)  # a shuffling DataLoader then draws one device's order
    state = net.state_dict()
    assert state
    for name, value in state.items():
        assert torch.equal(value, whole[name]), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_values_are_one_device_s_from_the_cuda_generator():
    cuda = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    with cuda:
        whole = _net().state_dict()
    after = torch.rand(4, device=cuda)
    net, drawn = _stage(_net, _keep_stage([2, 2], 1), device=cuda)
    assert torch.equal(drawn, after)
    for name, value in net.state_dict().items():
        assert value.device.type == "cuda" and torch.equal(value, whole[name]), name


def test_per_unit_values_are_not_one_device_s():
    whole, after = _one_device(_net)
    net, drawn = _stage(_net, _keep_stage([2, 2], 1), init_values="per_unit")
    assert not torch.equal(drawn, after)
    assert not torch.equal(net.state_dict()["head.weight"], whole["head.weight"])


def test_a_from_scratch_llama_stage_holds_one_device_s_values():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2
    )

    def keep_last_half(model: nn.Module) -> None:
        model.model.embed_tokens = None
        model.model.layers[0] = model.model.layers[1] = None

    whole, after = _one_device(lambda: transformers.LlamaForCausalLM(config))
    net, drawn = _stage(lambda: transformers.LlamaForCausalLM(config), keep_last_half)
    assert torch.equal(drawn, after)
    for name, value in net.state_dict().items():
        assert torch.equal(value, whole[name]), name


class Copied(nn.Module):
    """``b`` is a copy of ``a``'s random values, on another stage: one device's order computes it on ``b``'s rank."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        with torch.no_grad():
            self.blocks[1].weight.copy_(self.blocks[0].weight * 2)


def test_a_value_computed_from_another_stage_s_random_tensor_is_one_device_s():
    whole, _ = _one_device(Copied)

    def second(net: nn.Module) -> None:
        net.blocks[0] = None

    net, _ = _stage(Copied, second)
    assert torch.equal(net.blocks[1].weight, whole["blocks.1.weight"])
    with pytest.raises(PipelineModelError, match=r"`blocks.1.weight`.*reads `blocks.0.weight`"):
        _stage(Copied, second, init_values="per_unit")


class Reseeded(nn.Module):
    """Draws inside a ``fork_rng`` (undone on one device) and after a ``manual_seed``, as a ``configure_model`` may."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            self.blocks = nn.ModuleList([nn.Linear(4, 4)])
        self.blocks.append(nn.Linear(4, 4))
        torch.manual_seed(7)
        self.blocks.append(nn.Linear(4, 4))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_seed_or_fork_rng_in_configure_model_is_followed(stage):
    whole, after = _one_device(Reseeded)

    def keep(net: nn.Module) -> None:
        for i in {0, 1, 2} - {stage}:
            net.blocks[i] = None

    net, drawn = _stage(Reseeded, keep)
    assert torch.equal(drawn, after)
    for name, value in net.state_dict().items():
        assert torch.equal(value, whole[name]), name


class Poisson(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        with torch.no_grad():
            self.blocks[0].weight.copy_(torch.poisson(torch.ones(4, 4)))


def test_a_draw_whose_count_depends_on_values_is_refused_on_another_rank():
    def second(net: nn.Module) -> None:
        net.blocks[0] = None

    with pytest.raises(PipelineModelError, match=r"`poisson.default` at .*init_values='per_unit'"):
        _stage(Poisson, second)
    _stage(Poisson, second, init_values="per_unit")


class FromBase(nn.Module):
    """An adapter computed from the weight it adapts (as PiSSA's SVD of the base weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.adapter = nn.Parameter(torch.empty(4, 4))
        with torch.no_grad():
            self.adapter.copy_(self.base.weight * 0.5)


def test_a_tensor_computed_from_one_init_weights_loads_is_refused():
    with pytest.raises(PipelineModelError, match=r"`adapter`.*reads `base.weight`.*`init_weights` loads"):
        _stage(FromBase, lambda net: None, loaded=frozenset({"base.weight", "base.bias"}))


def test_draws_of_tensors_a_directory_loads_are_left_out_as_from_pretrained_leaves_them():
    """``from_pretrained`` draws nothing for the weights it loads: the stream is where it was, the rest drawn."""
    torch.manual_seed(0)
    expected = torch.rand(4)
    net, drawn = _stage(lambda: nn.Linear(4, 4), lambda net: None, loaded=frozenset({"weight", "bias"}))
    assert torch.equal(drawn, expected)
    torch.manual_seed(0)
    nn.Linear(4, 4)  # without a directory the construction draws
    expected = torch.rand(4)
    assert torch.equal(_stage(lambda: nn.Linear(4, 4), lambda net: None)[1], expected)


class SkipsMeta(nn.Module):
    """Initialises ``w`` in its hook only (as transformers 5 skips its init on the meta device)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4)])
        self.w = nn.Parameter(torch.empty(3))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, SkipsMeta):
            nn.init.normal_(module.w)


def test_a_tensor_the_recording_left_to_the_hook_is_named():
    with pytest.warns(UserWarning, match=r"init_values='one_device'.*\['w'\].*`_init_weights`.*'per_unit'"):
        net, _ = _stage(SkipsMeta, lambda net: None)
    assert not torch.isnan(net.w).any()


def test_init_values_is_checked_by_name():
    with pytest.raises(PipelineConfigError, match=r"`init_values='bogus'`.*'one_device'.*'per_unit'"):
        PipelineParallelStrategy(init_values="bogus")
    assert PipelineParallelStrategy().settings.init_values == "one_device"


def test_adapters_over_a_directory_are_from_pretrained_and_get_peft_model_s(tmp_path, tuner="lora-saved"):
    """The base weights' draws are left out (``from_pretrained`` loads them), the adapters' made in one device's
    order: a stage holding the last layers has one device's adapters, and the stream ends where one device's ends."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from lightning_pipe.split.initialization import loaded_names
    from tests.hf_pretrained import save_pretrained
    from tests.peft_models import peft_config

    directory = save_pretrained(tmp_path / "llama", "llama", True, layers=4)  # tied: its head drawn, then dropped
    config = transformers.AutoConfig.from_pretrained(directory)
    torch.manual_seed(0)
    whole = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(directory), peft_config(tuner))
    after = torch.rand(4)

    def build():
        return peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config), peft_config(tuner))

    def last_layers(model: nn.Module) -> None:
        inner = model.base_model.model.model
        inner.embed_tokens = inner.layers[0] = inner.layers[1] = None

    torch.manual_seed(0)
    with torch.device("meta"):
        loaded = loaded_names(build(), "")
    assert loaded and not any("lora_" in n or "hada_" in n for n in loaded)
    net, drawn = _stage(build, last_layers, loaded=loaded)
    assert torch.equal(drawn, after)
    trainable = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    assert trainable
    for name, value in trainable:
        assert torch.equal(value, whole.get_parameter(name)), name
