"""Hugging Face vision-language models under the pipeline: Llava (CLIP + projector + Llama), Qwen2-VL (3-D rope
positions from ``input_ids`` and ``image_grid_thw``) and Gemma3 (SigLIP, bidirectional image-token attention), cut by
their text model's plan with the vision tower on the first stage. At 2 processes under 1F1B and ZBVZeroBubble the
losses and validation equal one device's; a Llava directory (written in transformers 4.x's older names) starts a
run with the vision tower frozen, and its export reloads with ``from_pretrained``."""

from __future__ import annotations

import copy
import functools
import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_pipe import PipelineParallelStrategy  # noqa: E402
from lightning_pipe.checkpoint import export  # noqa: E402
from lightning_pipe.errors import PipelineModelError  # noqa: E402
from lightning_pipe.models import kind_of  # noqa: E402
from lightning_pipe.models.huggingface.plan import hf_layout, hf_placeholder  # noqa: E402
from lightning_pipe.models.huggingface.stage import hf_stage_call  # noqa: E402
from lightning_pipe.models.huggingface.vision import later_stage_call  # noqa: E402
from lightning_pipe.split.surgery import prune  # noqa: E402
from tests.hf_vision import LAYERS, LitVision, batches, build, probe, run_vision, save_pretrained  # noqa: E402
from tests.launch import SHARED_FOUR, SHARED_TWO, Launch  # noqa: E402
from tests.models import quiet_trainer  # noqa: E402

TOL = 1e-5
INDEX = "model.safetensors.index.json"
FAMILIES = {
    "llava": ("model.vision_tower", "model.multi_modal_projector"),
    "qwen2_vl": ("model.visual",),
    "gemma3": ("model.vision_tower", "model.multi_modal_projector"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vision_modules_join_the_embedding_before_the_text_blocks(family):
    layout = hf_layout(build(family))
    assert layout.pre == ("model.language_model.embed_tokens", *FAMILIES[family])
    assert layout.blocks == tuple(f"model.language_model.layers.{i}" for i in range(LAYERS))
    assert layout.post == ("model.language_model.norm", "lm_head")


def test_later_stages_leave_the_pixels_out():
    call = {"input_ids": 1, "pixel_values": 2, "pixel_values_videos": 3, "image_grid_thw": 4}
    assert later_stage_call(call) == {
        "input_ids": 1,
        "pixel_values": None,
        "pixel_values_videos": None,
        "image_grid_thw": 4,
    }


def test_older_llava_names_on_disk():
    network = build("llava")
    names = list(kind_of(network).disk_names(network, "model.language_model.norm.weight"))
    assert "language_model.model.norm.weight" in names
    assert "vision_tower.x.weight" in list(kind_of(network).disk_names(network, "model.vision_tower.x.weight"))


def _other_major_version(path, out):
    """The directory ``path`` as the other transformers major version writes it: the vision tower's weights with its
    ``vision_model`` wrapper (4.x) removed, or added (5.x)."""
    from safetensors.torch import load_file, save_file

    wrapped = any(".vision_model." in n for n, _ in build("llava").named_parameters())
    rename = (
        (lambda k: k.replace("vision_tower.vision_model.", "vision_tower."))
        if wrapped
        else (lambda k: k.replace("vision_tower.", "vision_tower.vision_model."))
    )
    shutil.copytree(path, out)
    for shard in out.glob("*.safetensors"):
        save_file({rename(k): v for k, v in load_file(shard).items()}, shard, metadata={"format": "pt"})
    index = out / INDEX
    stored = json.loads(index.read_text())
    stored["weight_map"] = {rename(k): v for k, v in stored["weight_map"].items()}
    index.write_text(json.dumps(stored))
    return out


@pytest.mark.parametrize("written_by", ["this version", "the other major version"])
def test_llava_directory_of_either_major_version_loads_as_from_pretrained(tmp_path, written_by):
    """transformers 4.x and 5.x both write the older names (`language_model.model.*`); 4.x's vision tower keeps its
    `vision_model` wrapper, 5.x's not: `init_weights` reads either directory, with the values `from_pretrained` of
    this version's own directory gives."""
    native = save_pretrained(tmp_path / "llava", "llava")
    assert any(k.startswith("language_model.model.") for k in json.loads((native / INDEX).read_text())["weight_map"])
    path = native if written_by == "this version" else _other_major_version(native, tmp_path / "other")

    class Loaded(LitVision):
        def on_train_start(self) -> None:
            self.loaded = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    model = Loaded("llava", path=str(path))
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0, strategy=PipelineParallelStrategy(init_weights=path))
    trainer.fit(model)
    want = transformers.LlavaForConditionalGeneration.from_pretrained(native).state_dict()
    assert model.loaded.keys() == want.keys()
    assert all(torch.equal(model.loaded[k], want[k]) for k in want), written_by


def _split(network, stages: list[list[str]]):
    layout = hf_layout(network)
    return [prune(copy.deepcopy(network), keep, layout.units, hf_placeholder(network)) for keep in stages]


def test_a_first_stage_of_only_the_vision_tower_and_embedding_is_exact():
    network = build("llava").eval()
    layout = hf_layout(network)
    ids, mask, labels, pixels = batches("llava", 2, 0).tensors
    call = dict(input_ids=ids, attention_mask=mask, labels=labels, pixel_values=pixels)
    first, second = _split(network, [list(layout.pre), [*layout.blocks, *layout.post]])
    with torch.no_grad():
        sent = hf_stage_call(first, (), call, None, True, False)
        out = hf_stage_call(second, (), call, (sent,), False, True)
        torch.testing.assert_close(out.loss, network(**call).loss, rtol=0, atol=1e-6)


def test_refuses_a_later_stage_without_blocks():
    network = build("llava")
    layout = hf_layout(network)
    _, last = _split(network, [[*layout.pre, *layout.blocks], list(layout.post)])
    ids, mask, labels, pixels = batches("llava", 2, 0).tensors
    with pytest.raises(
        PipelineModelError,
        match=r"stage of LlavaForConditionalGeneration.*after the first.*none of its blocks.*last stage.*`balance=`",
    ):
        hf_stage_call(last, (), dict(input_ids=ids, labels=labels), (torch.zeros(2, 12, 32),), False, True)


CONFIGS = [
    dict(name=f"{family}-{schedule}", family=family, schedule=schedule, devices=2)
    for family in sorted(FAMILIES)
    for schedule in ("1F1B", "ZBVZeroBubble")
] + [dict(name="llava-directory", family="llava", schedule="1F1B", devices=2, freeze_vision=True, directory=True)]


def _write_llava(work) -> None:
    save_pretrained(work / "llava", "llava")  # what the "directory" scenario starts from


# The launches' results, collected once per module: each test reads its own config's (Launch.ranks).
SHARED_TWO.part(__name__, "two", "hf_vision.py", CONFIGS, prepare=_write_llava)


@pytest.fixture(scope="module")
def two(request) -> Launch:
    return SHARED_TWO.launch(request)  # the 2-process launch shared with other modules (tests/launch.py Shared)


FOUR = [dict(name="llava-interleaved", family="llava", schedule="Interleaved1F1B", devices=4, layers=8)]
SHARED_FOUR.part(__name__, "four", "hf_vision.py", FOUR)


@pytest.fixture(scope="module")
def four(request) -> Launch:
    return SHARED_FOUR.launch(request)  # the 4-process launch shared with other modules (tests/launch.py Shared)


@functools.cache
def _one_device(family: str, freeze_vision: bool, path: str | None) -> dict:
    """One device's run per model: both schedules of a family compare with it."""
    directory = {} if path is None else {"path": path, "pretrained": True}
    return run_vision(family=family, freeze_vision=freeze_vision, **directory)


def _one_device_of(work, cfg: dict) -> dict:
    path = str(work / "llava") if cfg.get("directory") else None
    return _one_device(cfg["family"], cfg.get("freeze_vision", False), path)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS, ids=[cfg["name"] for cfg in CONFIGS])
def test_vision_language_model_2_procs_as_one_device(two, cfg):
    ranks = two.ranks(cfg["name"])
    one = _one_device_of(two.out, cfg)
    for found in ranks:
        torch.testing.assert_close(found["losses"], one["losses"], rtol=TOL, atol=0, msg=cfg["name"])
        torch.testing.assert_close(found["metrics"]["val_loss"], one["metrics"]["val_loss"], rtol=TOL, atol=0)
        for key, value in found["state"].items():
            want = one["state"][key]
            if "vision_tower" in key and cfg.get("freeze_vision"):
                assert torch.equal(value, want), key
                continue
            # to the tensor's scale: Gemma3's zero-initialised image projection grows to ~1e16 in this tiny
            # random model, where float sums differ in the 8th digit of the largest entries
            scale = float(want.abs().max()) if want.is_floating_point() and want.numel() else 1.0
            torch.testing.assert_close(value, want, rtol=TOL, atol=TOL * max(1.0, scale), msg=key)


@pytest.mark.extended
@pytest.mark.slow
def test_llava_started_from_its_directory_exports_for_from_pretrained_2_procs(two):
    two.ranks("llava-directory")  # the run and its checkpoint ended without error
    one = _one_device_of(two.out, next(cfg for cfg in CONFIGS if cfg["name"] == "llava-directory"))
    out = export.export(two.out / "ckpt-llava-directory", two.out / "export")
    exported = transformers.LlavaForConditionalGeneration.from_pretrained(out, attn_implementation="eager")
    torch.testing.assert_close(probe(exported, "llava"), probe(one["model"].model, "llava"), rtol=0, atol=TOL)


def test_tensor_parallelism_of_a_vision_language_model_is_refused_by_name():
    from lightning_pipe.models.huggingface.tensor_parallel import hf_tensor_parallel_plan

    with pytest.raises(PipelineModelError, match=r"LlavaForConditionalGeneration has no tensor-parallel plan"):
        hf_tensor_parallel_plan(build("llava"), 2, [])


@pytest.mark.extended
@pytest.mark.slow
def test_vision_language_model_interleaved_1f1b_4_procs(four):
    """Llava with 8 text layers, 8 stages on 4 processes (Interleaved1F1B, 2 stages each): the vision tower and
    projector on the first stage, losses, validation and parameters as on one device."""
    ranks = four.ranks("llava-interleaved")
    one = run_vision(family="llava", layers=8)
    for found in ranks:
        torch.testing.assert_close(found["losses"], one["losses"], rtol=TOL, atol=0)
        torch.testing.assert_close(found["metrics"]["val_loss"], one["metrics"]["val_loss"], rtol=TOL, atol=0)
        for key, value in found["state"].items():
            torch.testing.assert_close(value, one["state"][key], rtol=TOL, atol=TOL, msg=key)
