"""PEFT adapters under the pipeline: the PEFT model kind (units under peft's prefix, names on disk, refusals), and
fine-tunes of tiny pretrained Llama and Qwen2 directories (tied and untied, several shards) with LoRA, LoRA with
``modules_to_save`` and LoHa, equal to a single-device ``from_pretrained`` + ``get_peft_model`` run."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lightning_pipe import PipelineParallelStrategy  # noqa: E402
from lightning_pipe.errors import PipelineConfigError, PipelineModelError  # noqa: E402
from lightning_pipe.models import kind_of  # noqa: E402
from lightning_pipe.models.peft import PeftKind, base_name  # noqa: E402
from tests.hf_models import build  # noqa: E402
from tests.hf_pretrained import save_pretrained  # noqa: E402
from tests.launch import run_script  # noqa: E402
from tests.peft_models import fine_tune, peft_config  # noqa: E402

TOL = 1e-5
DIRECTORIES = ("llama-tied", "llama-untied", "qwen2-tied", "qwen2-untied")


def _peft_model(tuner: str = "lora", family: str = "llama", tie: bool = True):
    torch.manual_seed(0)
    return peft.get_peft_model(build(family, tie, layers=4), peft_config(tuner))


def test_kind_of_a_peft_model_is_the_peft_kind():
    network = _peft_model()
    kind = kind_of(network)
    assert isinstance(kind, PeftKind)
    assert kind.name == "peft PeftModel of transformers LlamaForCausalLM"


def test_units_are_the_wrapped_models_plan_units_under_peft_prefix():
    network = _peft_model()
    layout = kind_of(network).layout(network)
    assert layout.pre == ("base_model.model.model.embed_tokens",)
    assert layout.blocks == tuple(f"base_model.model.model.layers.{i}" for i in range(4))
    assert layout.post == ("base_model.model.model.norm", "base_model.model.lm_head")
    placeholder = kind_of(network).placeholder(network)
    assert type(placeholder("base_model.model.model.layers.2")).__name__ == "PassThrough"
    assert type(placeholder("base_model.model.model.embed_tokens")).__name__ == "AbsentInput"
    assert type(placeholder("base_model.model.lm_head")).__name__ == "AbsentOutput"


@pytest.mark.parametrize(
    ("name", "stored"),
    [
        (
            "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
            "model.layers.0.self_attn.q_proj.weight",
        ),  # noqa: E501
        ("base_model.model.model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.weight"),
        ("base_model.model.model.norm.modules_to_save.default.weight", "model.norm.weight"),
        ("base_model.model.model.norm.original_module.weight", "model.norm.weight"),
        ("base_model.model.lm_head.weight", "lm_head.weight"),
    ],
)
def test_base_weights_have_the_wrapped_models_names_on_disk(name, stored):
    network = _peft_model("lora-saved")
    assert base_name(name) == stored
    assert next(iter(kind_of(network).disk_names(network, name))) == stored


def test_adapters_have_no_name_on_disk_and_may_be_missing():
    network = _peft_model("loha")
    kind = kind_of(network)
    for name, _ in network.named_parameters():
        if ".hada_" in name:
            assert list(kind.disk_names(network, name)) == []
    ignored, _ = kind.ignored_on_load(network)
    import re

    assert any(re.search(p, "base_model.model.model.layers.0.self_attn.q_proj.hada_w1_a.default") for p in ignored)
    assert not any(re.search(p, "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") for p in ignored)


def test_prompt_learning_tuner_is_refused_by_name():
    network = peft.get_peft_model(
        build("llama", True, layers=2), peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    )
    with pytest.raises(PipelineModelError, match=r"PeftModelForCausalLM wraps LlamaForCausalLM .*PREFIX_TUNING"):
        kind_of(network)


def test_dora_is_refused_by_name():
    torch.manual_seed(0)
    network = peft.get_peft_model(
        build("llama", True, layers=2), peft.LoraConfig(target_modules=["q_proj"], use_dora=True)
    )
    with pytest.raises(PipelineModelError, match=r"PeftModel has DoRA adapters \(\['default'\], `use_dora=True`\)"):
        kind_of(network)


def test_tensor_parallelism_is_refused_for_a_peft_model():
    network = _peft_model()
    with pytest.raises(PipelineConfigError, match=r"`tensor_parallel=2` with a PEFT model \(PeftModel\)"):
        kind_of(network).tensor_parallel_plan(network, 2)


def test_dataflow_frontend_is_refused_for_a_peft_model():
    network = _peft_model()
    with pytest.raises(PipelineModelError, match=r"PeftModel \(a PEFT model\).*`frontend='auto'`"):
        kind_of(network).dataflow_order(network)


# ------------------------------------------------------------------------------------------------ multi-process
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("peft")
    for name in DIRECTORIES:
        family, tie = name.split("-")
        save_pretrained(work / name, family, tie == "tied", seed=len(name))
    return work


@functools.cache
def _reference(path: str, tuner: str, start: tuple) -> tuple[list[float], float, dict, dict]:
    model, _, val = fine_tune(path, tuner, start=dict(start))
    return model.step_losses, val, model.initial, model.frozen


def _check(work, schedule: str, nprocs: int, runs: list[str]) -> None:
    for run in runs:
        name, tuner = run.split(":")
        ranks = [torch.load(work / f"{schedule}-{name}-{tuner}.rank{r}.pt") for r in range(nprocs)]
        initial = {k: v for rank in ranks for k, v in rank["initial"].items()}
        losses, val, trainable, frozen = _reference(str(work / name), tuner, tuple(sorted(initial.items())))
        assert sorted(initial) == sorted(trainable), run  # every adapter on exactly the ranks' stages
        for key, value in initial.items():  # peft's initialisation: the second factor starts at zero
            if ".lora_B." in key or ".hada_w2_b." in key:
                assert not value.any(), key
        for rank in ranks:
            torch.testing.assert_close(rank["losses"], losses, rtol=TOL, atol=0)
            torch.testing.assert_close(rank["val"], val, rtol=TOL, atol=0)
            assert rank["frozen_unchanged"], run
            # the base weights loaded from the directory, under peft's names, as from_pretrained loads them
            assert all(torch.equal(v, frozen[k]) for k, v in rank["frozen_loaded"].items()), run
            # gradients and optimizer state for the trainable tensors only
            assert rank["optimizer_state"] == len(rank["initial"]), run
        _check_checkpoint(work / f"ckpt-{schedule}-{name}-{tuner}", ranks, frozen)


def _check_checkpoint(path, ranks: list[dict], frozen: dict) -> None:
    """The run's checkpoint holds the trained adapters and the frozen base under peft's names, and optimizer state
    for the adapters only."""
    from lightning_pipe.checkpoint import convert

    stored = convert.load_model_weights(path)
    final = {k: v for rank in ranks for k, v in rank["final"].items()}
    assert all(torch.equal(stored[k], v) for k, v in final.items()), path
    assert all(torch.equal(stored[k], frozen[k]) for k in frozen if k in stored), path
    assert set(stored) <= set(final) | set(frozen), path
    (state,) = convert.load_optimizer_states(path)["optimizer_states"]
    assert len(state["state"]) == len(final), path  # a momentum buffer per adapter tensor, none for the base


@pytest.mark.slow
def test_lora_loha_modules_to_save_1f1b_2_procs(work):
    runs = ["llama-tied:lora", "llama-untied:lora-saved", "qwen2-tied:loha", "qwen2-untied:lora-late"]
    run_script("peft_adapters.py", str(work), "1F1B", "2", *runs, nprocs=2)
    _check(work, "1F1B", 2, runs)
    # the adapters start as on one process for the same seed (per-tensor seeds: whatever the layout)
    model, _, _ = fine_tune(
        work / "llama-tied", "lora", PipelineParallelStrategy(init_weights=work / "llama-tied"), devices=1
    )
    ranks = [torch.load(work / f"1F1B-llama-tied-lora.rank{r}.pt") for r in range(2)]
    initial = {k: v for rank in ranks for k, v in rank["initial"].items()}
    assert all(torch.equal(initial[k], v) for k, v in model.initial.items())


@pytest.mark.extended
@pytest.mark.slow
def test_frozen_first_stage_lora_zbv_zero_bubble_2_procs(work):
    """ZBVZeroBubble splits each backward in two; with `lora-late` the stages before layer 6 hold no adapter, and
    the gradients still reach the later stages' adapters."""
    runs = ["llama-tied:lora-late", "qwen2-tied:lora"]
    run_script("peft_adapters.py", str(work), "ZBVZeroBubble", "2", *runs, nprocs=2)
    _check(work, "ZBVZeroBubble", 2, runs)


@pytest.mark.extended
@pytest.mark.slow
def test_lora_interleaved_1f1b_4_procs(work):
    runs = ["llama-tied:lora", "qwen2-untied:loha"]
    run_script("peft_adapters.py", str(work), "Interleaved1F1B", "4", *runs, nprocs=4, launcher="torchrun")
    _check(work, "Interleaved1F1B", 4, runs)
