"""Fine-tuning a pretrained Hugging Face directory under the pipeline, and exporting the result for
``from_pretrained``: a tiny Llama and Qwen2, tied and untied, saved in several shards, fine-tuned from the directory
with 1F1B at 2 processes and Interleaved1F1B at 4, equal to a single-device ``from_pretrained`` fine-tune; exported,
``from_pretrained`` of the export gives the single-device fine-tuned model's logits."""

from __future__ import annotations

import functools
import json

import pytest
import torch

pytest.importorskip("transformers")

from lightning_pipe.checkpoint import export  # noqa: E402
from lightning_pipe.models.huggingface import export as hf_export  # noqa: E402
from tests.hf_pretrained import fine_tune, probe_logits, save_pretrained  # noqa: E402
from tests.launch import SHARED_FOUR, SHARED_TWO, Launch  # noqa: E402

NAMES = ("llama-tied", "llama-untied", "qwen2-tied", "qwen2-untied")
TOL = 1e-5


def _write_directories(work) -> None:
    """The model directories the scenarios fine-tune from, in ``work``."""
    for name in NAMES:
        family, tie = name.split("-")
        save_pretrained(work / name, family, tie == "tied", seed=len(name))
    save_pretrained(work / "llama-6-layers", "llama", True, layers=6)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("hf-pretrained")
    _write_directories(work)
    return work


@functools.cache
def reference(path: str) -> tuple[list[float], torch.Tensor]:
    """Losses and probe logits of a single-device `from_pretrained` fine-tune of the directory."""
    model, _ = fine_tune(path)
    return model.step_losses, probe_logits(model.model)


def _fine_tunes(schedule: str, devices: int) -> list[dict]:
    return [
        dict(name=f"{schedule}-{name}", run="fine-tune", schedule=schedule, devices=devices, directory=name)
        for name in NAMES
    ]


CHECKS = [dict(name="bf16", run="bf16"), dict(name="ckpt-path", run="ckpt-path")] + [
    dict(name=f"error-{error}", run="error", error=error)
    for error in ("model-type", "missing", "unexpected", "fit-resume")
]


# The launches' results, collected once per module: each test reads its own run's (Launch.ranks).
SHARED_TWO.part(__name__, "one_f_one_b", "hf_pretrained.py", _fine_tunes("1F1B", 2), prepare=_write_directories)


@pytest.fixture(scope="module")
def one_f_one_b(request) -> Launch:
    return SHARED_TWO.launch(request)  # the 2-process launch shared with other modules (tests/launch.py Shared)


SHARED_FOUR.part(
    __name__, "interleaved", "hf_pretrained.py", _fine_tunes("Interleaved1F1B", 4), prepare=_write_directories
)


@pytest.fixture(scope="module")
def interleaved(request) -> Launch:
    return SHARED_FOUR.launch(request)  # the 4-process launch shared with other modules (tests/launch.py Shared)


SHARED_TWO.part(__name__, "checks", "hf_pretrained.py", CHECKS, prepare=_write_directories)


@pytest.fixture(scope="module")
def checks(request) -> Launch:
    return SHARED_TWO.launch(request)  # the 2-process launch shared with other modules (tests/launch.py Shared)


def _check_fine_tune(launch: Launch, schedule: str, name: str) -> None:
    import transformers

    ranks = launch.ranks(f"{schedule}-{name}")
    work = launch.out
    losses, logits = reference(str(work / name))
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], losses, rtol=TOL, atol=0)
        assert rank["load_peak"][0] is not None
    src, dst = work / f"ckpt-{schedule}-{name}", work / f"export-{schedule}-{name}"
    out = export.export(src, dst, max_shard_size="40KB")
    files = sorted(p.name for p in out.iterdir())
    assert "config.json" in files and "generation_config.json" in files and hf_export.INDEX in files
    assert len([f for f in files if f.endswith(".safetensors")]) > 1
    weight_map = json.loads((out / hf_export.INDEX).read_text())["weight_map"]
    assert ("lm_head.weight" in weight_map) == name.endswith("untied")
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert (exported.lm_head.weight is exported.model.embed_tokens.weight) == name.endswith("-tied")
    torch.testing.assert_close(probe_logits(exported), logits, rtol=0, atol=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_fine_tune_from_directory_and_export_1f1b_2_procs(one_f_one_b, name):
    _check_fine_tune(one_f_one_b, "1F1B", name)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_fine_tune_from_directory_and_export_interleaved_4_procs(interleaved, name):
    _check_fine_tune(interleaved, "Interleaved1F1B", name)


@pytest.mark.slow
def test_bf16_true_each_rank_loads_its_own_stages_in_bf16_2_procs(checks):
    ranks = checks.ranks("bf16")
    for rank in ranks:
        assert rank["dtypes"] == ["torch.bfloat16"] and rank["bf16_equal"]
    # each rank holds (and read) only its own stages' tensors
    assert not set(ranks[0]["keys"]) & set(ranks[1]["keys"]) - {"model.lm_head.weight"}
    assert "model.lm_head.weight" in ranks[1]["keys"] and "model.model.embed_tokens.weight" in ranks[0]["keys"]


@pytest.mark.slow
def test_validate_with_the_directory_as_ckpt_path_2_procs(checks):
    for rank in checks.ranks("ckpt-path"):
        assert rank["ckpt_path_equal"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("error", "message"),
    [
        ("model-type", "holds a 'llama' model (its config.json) but the network is a Qwen2ForCausalLM"),
        ("missing", "the model's 'model.lm_head.weight' are not in it"),
        ("unexpected", "it holds 'model.layers.6.input_layernorm.weight'"),
        ("fit-resume", "is a Hugging Face model directory: it holds weights only"),
    ],
    ids=["model-type", "missing", "unexpected", "fit-resume"],
)
def test_every_rank_raises_the_same_error_2_procs(checks, error, message):
    messages = {rank["error"] for rank in checks.ranks(f"error-{error}")}
    assert len(messages) == 1, f"ranks disagree on {error}: {messages}"
    assert message in messages.pop()


@pytest.mark.slow
def test_one_stage_from_directory_equals_from_pretrained(work):
    """A one-process pipeline keeps the tied head one parameter with the embedding, as on one device."""
    from lightning_pipe import PipelineParallelStrategy

    path = work / "llama-tied"
    losses, logits = reference(str(path))
    model, _ = fine_tune(path, PipelineParallelStrategy(init_weights=path), devices=1)
    torch.testing.assert_close(model.step_losses, losses, rtol=TOL, atol=0)
    assert model.model.lm_head.weight is model.model.model.embed_tokens.weight
