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
from tests.launch import Launch, run_script  # noqa: E402
from tests.peft_models import fine_tune, peft_config  # noqa: E402
from tests.scripts.peft_adapters import label  # noqa: E402

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
def _reference_run(path: str, tuner: str, start: tuple | None, bare: bool = False):
    return fine_tune(path, tuner, start=dict(start) if start else None, bare=bare)


def _reference(path: str, tuner: str, start: tuple = (), bare: bool = False) -> tuple[list[float], float, dict, dict]:
    """One device's fine-tune; with ``start``, from those trainable values (else peft's own draws)."""
    model, _, val = _reference_run(path, tuner, start or None, bare)
    return model.step_losses, val, model.initial, model.frozen


def _reference_model(path: str, tuner: str, start: tuple):
    """The single-device fine-tuned PEFT model (``from_pretrained`` + ``get_peft_model``)."""
    return _reference_run(path, tuner, start)[0].model


def _launch(work, schedule: str, nprocs: int, runs: list[str], **kwargs) -> Launch:
    """One launch of ``runs``, once per module; each run's test reads its own outcome (:meth:`Launch.ranks`)."""
    proc = run_script("peft_adapters.py", str(work), schedule, str(nprocs), *runs, nprocs=nprocs, check=False, **kwargs)
    return Launch(work, nprocs, proc)


def _ranks(launch: Launch, schedule: str, run: str) -> list[dict]:
    """The run's per-rank results; fails with the run's own traceback (the run and its continuation)."""
    return launch.ranks(f"{schedule}-{label(run)}")


def _check(launch: Launch, schedule: str, run: str) -> None:
    name, tuner = run.split(":")[:2]
    ranks = _ranks(launch, schedule, run)
    initial = {k: v for rank in ranks for k, v in rank["initial"].items()}
    # one device: from_pretrained + get_peft_model drawing the adapters from the same seed (init_values="one_device")
    losses, val, trainable, frozen = _reference(str(launch.out / name), tuner, bare=run.endswith(":bare"))
    assert sorted(initial) == sorted(trainable), run  # every adapter on exactly the ranks' stages
    assert all(torch.equal(value, trainable[key]) for key, value in initial.items()), run
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
    _check_checkpoint(launch.out / f"ckpt-{schedule}-{label(run)}", ranks, frozen)


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


# ------------------------------------------------------------------------------------------------ export
_IDS = torch.tensor([[3, 17, 42, 5, 9, 60, 2, 30], [7, 7, 1, 58, 13, 4, 50, 21]])


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=_IDS).logits


def _check_exports(ckpt, base_dir, out, reference) -> None:
    """``export-hf --adapter`` loads with ``PeftModel.from_pretrained(base, OUT)`` and ``--merge`` with
    ``from_pretrained(OUT)``, each giving the logits of ``reference`` (a fine-tuned PEFT model) within 1e-5."""
    import transformers

    from lightning_pipe.checkpoint.__main__ import main

    expected = _logits(reference)
    assert main(["export-hf", str(ckpt), str(out / "adapter"), "--adapter", "--no-progress"]) == 0
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in (out / "adapter").iterdir()}
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    loaded = peft.PeftModel.from_pretrained(base, out / "adapter")
    torch.testing.assert_close(_logits(loaded), expected, rtol=TOL, atol=TOL)
    assert main(["export-hf", str(ckpt), str(out / "merged"), "--merge", "--no-progress"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged")
    assert not any("lora" in n or "hada" in n or "base_layer" in n for n in merged.state_dict())
    torch.testing.assert_close(_logits(merged), expected, rtol=TOL, atol=TOL)


def _from_checkpoint(ckpt, base_dir, tuner: str):
    """``from_pretrained`` + ``get_peft_model`` with the trainable tensors stored in the checkpoint ``ckpt``."""
    import transformers

    from lightning_pipe.checkpoint import convert

    stored = convert.load_model_weights(ckpt)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base_dir), peft_config(tuner))
    trainable = {n: stored["model." + n] for n, p in model.named_parameters() if p.requires_grad}
    model.load_state_dict(trainable, strict=False)
    return model


@pytest.mark.parametrize(("directory", "tuner"), [("llama-tied", "lora-saved"), ("qwen2-untied", "loha")])
def test_export_adapter_and_merged_from_a_one_process_run(tmp_path, directory, tuner):
    family, tie = directory.split("-")
    base_dir = save_pretrained(tmp_path / directory, family, tie == "tied", layers=4)
    strategy = PipelineParallelStrategy(init_weights=base_dir)
    _, trainer, _ = fine_tune(base_dir, tuner, strategy, devices=1, max_steps=2)
    trainer.save_checkpoint(tmp_path / "ckpt")
    reference = _from_checkpoint(tmp_path / "ckpt", base_dir, tuner)
    assert any(reference.get_parameter(n).any() for n in reference.state_dict() if ".lora_B." in n or "hada" in n)
    _check_exports(tmp_path / "ckpt", base_dir, tmp_path, reference)


def test_export_of_a_peft_checkpoint_names_adapter_and_merge(tmp_path):
    from lightning_pipe.checkpoint import export
    from lightning_pipe.errors import PipelineCheckpointError

    base_dir = save_pretrained(tmp_path / "llama", "llama", True, layers=2)
    _, trainer, _ = fine_tune(base_dir, "lora", PipelineParallelStrategy(init_weights=base_dir), max_steps=1)
    trainer.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(PipelineCheckpointError, match=r"PEFT model.*`--adapter`.*`--merge`"):
        export.export(tmp_path / "ckpt", tmp_path / "out")
    with pytest.raises(PipelineCheckpointError, match=r"`--adapter` and `--merge` exclude each other"):
        export.export(tmp_path / "ckpt", tmp_path / "out", adapter=True, merge=True)
    assert not (tmp_path / "out").exists()


#: `:bare`: the steps of a one-device script (the model's own loss from `labels=`, no `num_items`), exact because the
#: strategy counts each microbatch's labelled tokens (tests/test_token_mean.py)
RUNS_1F1B = [
    "llama-tied:lora",
    "llama-untied:lora-saved:continue",
    "qwen2-tied:loha",
    "qwen2-untied:lora-late",
    "llama-untied:lora:bare",
]
#: ZBVZeroBubble splits each backward in two; with `lora-late` the stages before layer 6 hold no adapter, and the
#: gradients still reach the later stages' adapters.
RUNS_ZBV = ["llama-tied:lora-late", "qwen2-tied:lora", "llama-untied:lora:bare"]
RUNS_INTERLEAVED = ["llama-tied:lora", "qwen2-untied:loha"]


@pytest.fixture(scope="module")
def one_f_one_b(work) -> Launch:
    return _launch(work, "1F1B", 2, RUNS_1F1B)


@pytest.fixture(scope="module")
def zbv(work) -> Launch:
    return _launch(work, "ZBVZeroBubble", 2, RUNS_ZBV)


@pytest.fixture(scope="module")
def interleaved(work) -> Launch:
    return _launch(work, "Interleaved1F1B", 4, RUNS_INTERLEAVED, launcher="torchrun")


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS_1F1B)
def test_lora_loha_modules_to_save_1f1b_2_procs(one_f_one_b, run):
    _check(one_f_one_b, "1F1B", run)


@pytest.mark.slow
def test_per_unit_adapters_are_drawn_under_their_own_seeds(work):
    # init_values="per_unit": per-tensor seeds, the same whatever the layout, not the numbers peft draws on one device
    strategy = PipelineParallelStrategy(init_weights=work / "llama-tied", init_values="per_unit")
    model, _, _ = fine_tune(work / "llama-tied", "lora", strategy, devices=1)
    one_device = _reference(str(work / "llama-tied"), "lora")[2]
    lora_a = [k for k in model.initial if ".lora_A." in k]
    assert lora_a and not any(torch.equal(model.initial[k], one_device[k]) for k in lora_a)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["llama-untied:lora-saved", "qwen2-tied:loha"])
def test_a_2_procs_checkpoint_exports_adapters_and_merged_model_as_one_device(one_f_one_b, work, run):
    # adapters and merged model give the single-device fine-tune's logits
    name, tuner = run.split(":")
    start = {k: v for rank in _ranks(one_f_one_b, "1F1B", run) for k, v in rank["initial"].items()}
    reference = _reference_model(str(work / name), tuner, tuple(sorted(start.items())))
    _check_exports(work / f"ckpt-1F1B-{name}-{tuner}", work / name, work / f"export-{name}-{tuner}", reference)


@pytest.mark.slow
def test_a_fine_tune_continued_from_its_exported_adapters_2_procs(one_f_one_b, work):
    _ranks(one_f_one_b, "1F1B", "llama-untied:lora-saved")  # the run and its continuation ended without error
    _check_continued(work, "1F1B", 2, "llama-untied", "lora-saved")


def _check_continued(work, schedule: str, nprocs: int, name: str, tuner: str) -> None:
    """The second phase of a `:continue` run: started from the first phase's exported adapters (`init_adapter`),
    its adapters are the first phase's trained ones, as `PeftModel.from_pretrained` loads them, and it trains as one
    device does from that adapter directory."""
    from tests.peft_models import peft_start

    first = [torch.load(work / f"{schedule}-{name}-{tuner}.rank{r}.pt") for r in range(nprocs)]
    ranks = [torch.load(work / f"continued-{schedule}-{name}-{tuner}.rank{r}.pt") for r in range(nprocs)]
    initial = {k: v for rank in ranks for k, v in rank["initial"].items()}
    final = {k: v for rank in first for k, v in rank["final"].items()}
    start = peft_start(work / name, work / f"adapter-{schedule}-{name}-{tuner}")
    assert sorted(initial) == sorted(start) == sorted(final)
    assert all(torch.equal(initial[k], v) and torch.equal(final[k], v) for k, v in start.items())
    reference, _, val = fine_tune(work / name, tuner, start=start, max_steps=2)
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], reference.step_losses, rtol=TOL, atol=0)
        torch.testing.assert_close(rank["val"], val, rtol=TOL, atol=0)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS_ZBV)
def test_frozen_first_stage_lora_zbv_zero_bubble_2_procs(zbv, run):
    _check(zbv, "ZBVZeroBubble", run)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS_INTERLEAVED)
def test_lora_interleaved_1f1b_4_procs(interleaved, run):
    _check(interleaved, "Interleaved1F1B", run)


def test_units_of_a_peft_model_are_timed_as_its_stages_call_them():
    # As for a transformers model (tests/test_hf.py): the wrapped model's cache, on by default, would grow with every
    # timed call of a block; the PEFT kind's `prepare_profile_call` turns it off as its stages do.
    from lightning_pipe.split.balance import profile_units
    from tests.hf_models import SEQ, VOCAB, build
    from tests.peft_models import peft_config

    network = peft.get_peft_model(build("llama", tie=True, layers=2), peft_config("lora")).train()
    assert network.base_model.model.config.use_cache
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    call = {"input_ids": ids, "labels": ids}
    assert kind_of(network).prepare_profile_call(network, (), call)[1]["use_cache"] is False
    layout = kind_of(network).layout(network)
    profiles = profile_units(network, layout, (), call, torch.device("cpu"), repeats=2)
    block = next(p for p in profiles if p.name == layout.blocks[0])
    assert block.measured and block.time_s > 0
