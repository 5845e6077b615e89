"""Continuing a PEFT fine-tune from an adapter directory (``init_adapter``): the adapters start as
``PeftModel.from_pretrained(base, DIR, is_trainable=True)`` loads them, training goes on as on one device, and an
adapter directory that does not match the model is refused by name. The two-process check is a second phase of
``tests/scripts/peft_adapters.py`` (``tests/test_peft.py``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lightning_pipe import PipelineParallelStrategy  # noqa: E402
from lightning_pipe.errors import PipelineCheckpointError, PipelineConfigError  # noqa: E402
from lightning_pipe.models.peft_io import adapter_directory, saved_name  # noqa: E402
from tests.hf_pretrained import fine_tune as fine_tune_full  # noqa: E402
from tests.hf_pretrained import save_pretrained  # noqa: E402
from tests.peft_models import fine_tune, peft_config, peft_start, save_adapter  # noqa: E402

TOL = 1e-5


@pytest.mark.parametrize(
    ("name", "adapter", "saved"),
    [
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", "default", "q_proj.lora_A.weight"),
        ("base_model.model.model.layers.0.mlp.down_proj.hada_w1_a.default", "default", "down_proj.hada_w1_a"),
        ("base_model.model.model.norm.modules_to_save.other.weight", "other", "model.norm.weight"),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.other.weight", "default", None),
        ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "default", None),
        ("base_model.model.model.norm.original_module.weight", "default", None),
    ],
)
def test_saved_name_is_peft_s_name_without_the_adapter(name, adapter, saved):
    prefix = "hada_" if "hada" in name else "lora_"
    found = saved_name(name, adapter, prefix)
    assert found == saved if saved is None else found.endswith(saved) and found.startswith("base_model.model.")


def test_adapter_directory_is_peft_s_layout(tmp_path):
    for path in (tmp_path, tmp_path / "second"):
        path.mkdir(exist_ok=True)
        (path / "adapter_config.json").write_text("{}")
        (path / "adapter_model.safetensors").write_bytes(b"")
    assert adapter_directory(tmp_path, "default", 2) == tmp_path
    assert adapter_directory(tmp_path, "second", 2) == tmp_path / "second"
    assert adapter_directory(tmp_path, "only", 1) == tmp_path  # one adapter of another name: the directory itself
    with pytest.raises(PipelineCheckpointError, match=r"adapter 'third' is not in it: .*third/adapter_config\.json"):
        adapter_directory(tmp_path, "third", 2)
    (tmp_path / "second" / "adapter_model.safetensors").unlink()
    with pytest.raises(PipelineCheckpointError, match=r"second'.*no adapter_model\.safetensors.*incomplete"):
        adapter_directory(tmp_path, "second", 2)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_pretrained(tmp_path_factory.mktemp("peft-adapter") / "llama", "llama", True, layers=4)


@pytest.mark.parametrize("tuner", ["lora-saved", "loha"])
def test_continue_from_an_adapter_directory_as_on_one_device(tmp_path, base_dir, tuner):
    adapter = save_adapter(base_dir, tmp_path / "adapter", peft_config(tuner))
    strategy = PipelineParallelStrategy(init_weights=base_dir, init_adapter=adapter)
    model, _, val = fine_tune(base_dir, tuner, strategy, max_steps=2)
    start = peft_start(base_dir, adapter)
    assert sorted(model.initial) == sorted(start)
    assert all(torch.equal(model.initial[k], v) for k, v in start.items())  # peft's own load, bitwise
    assert any(v.any() for k, v in start.items() if ".lora_B." in k or ".hada_w2_b" in k)  # not peft's fresh init
    reference, _, reference_val = fine_tune(base_dir, tuner, start=start, max_steps=2)
    torch.testing.assert_close(model.step_losses, reference.step_losses, rtol=TOL, atol=0)
    torch.testing.assert_close(val, reference_val, rtol=TOL, atol=0)


def test_adapter_saved_with_another_config_is_refused_by_field(tmp_path, base_dir):
    wider = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj"])
    adapter = save_adapter(base_dir, tmp_path / "adapter", wider)
    strategy = PipelineParallelStrategy(init_weights=base_dir, init_adapter=adapter)
    with pytest.raises(
        PipelineCheckpointError,
        match=r"adapter 'default' \(LoraConfig\).*r is 8 in adapter_config\.json but 4 in the model's; lora_alpha is"
        r" 16 .* but 8 .*; target_modules is \['k_proj', 'q_proj'\] .* but \['q_proj', 'v_proj'\].*"
        r"PeftConfig\.from_pretrained",
    ):
        fine_tune(base_dir, "lora", strategy, max_steps=1)


def test_adapter_directory_without_the_models_adapter_is_refused_by_name(tmp_path, base_dir):
    adapter = save_adapter(base_dir, tmp_path / "adapter", peft_config("lora"))
    (tmp_path / "adapter" / "second").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").rename(tmp_path / "adapter" / "second" / "adapter_config.json")
    strategy = PipelineParallelStrategy(init_weights=base_dir, init_adapter=adapter)
    with pytest.raises(PipelineCheckpointError, match=r"adapter 'default' is not in it"):
        fine_tune(base_dir, "lora", strategy, max_steps=1)


def test_init_adapter_without_a_peft_model_is_refused(tmp_path, base_dir):
    adapter = save_adapter(base_dir, tmp_path / "adapter", peft_config("lora"))
    strategy = PipelineParallelStrategy(init_weights=base_dir, init_adapter=adapter)
    with pytest.raises(PipelineConfigError, match=r"`init_adapter=.*adapter.`.*LlamaForCausalLM\) is not a PEFT"):
        fine_tune_full(base_dir, strategy, max_steps=1)


def test_adapter_directory_with_an_adapter_the_model_lacks_is_refused_by_name(tmp_path, base_dir):
    adapter = save_adapter(base_dir, tmp_path / "adapter", peft_config("lora"))
    save_adapter(base_dir, tmp_path / "other", peft_config("lora"))
    (tmp_path / "other").rename(adapter / "second")
    strategy = PipelineParallelStrategy(init_weights=base_dir, init_adapter=adapter)
    with pytest.raises(
        PipelineCheckpointError, match=r"holds adapters \['second'\] .* \(its adapters: \['default'\]\)"
    ):
        fine_tune(base_dir, "lora", strategy, max_steps=1)
