"""Hugging Face task heads under the pipeline: sequence classification (a reward model, right and left padding; a
classifier), token classification and question answering. The head is a unit of the last stage; fine-tuned from a
``save_pretrained`` directory at 2 processes under 1F1B and ZBVZeroBubble, the losses and validation equal a
single-device ``from_pretrained`` fine-tune's, through ``labels=`` and through a loss on ``logits``; the export
reloads with ``from_pretrained`` and gives the same logits. A causal LM's directory starts a classifier, the new head
initialised by the model's own ``_init_weights`` as ``from_pretrained`` does."""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_pipe import PipelineParallelStrategy  # noqa: E402
from lightning_pipe.checkpoint import export  # noqa: E402
from lightning_pipe.models import kind_of  # noqa: E402
from lightning_pipe.models.huggingface import directory as hf  # noqa: E402
from lightning_pipe.models.huggingface.plan import hf_layout  # noqa: E402
from tests.hf_heads import TASKS, config, fine_tune, lora_config, probe, save_pretrained  # noqa: E402
from tests.launch import SHARED_TWO, Launch  # noqa: E402

TOL = 1e-5


def _cfg(name, task, schedule, side="right", user_loss=False, **extra):
    return dict(name=name, task=task, schedule=schedule, side=side, user_loss=user_loss, **extra)


CONFIGS = [
    _cfg("reward-right-1f1b", "reward", "1F1B"),
    _cfg("reward-left-1f1b", "reward", "1F1B", "left", user_loss=True),
    _cfg("reward-left-zbv", "reward", "ZBVZeroBubble", "left"),
    _cfg("classifier-zbv", "classifier", "ZBVZeroBubble", user_loss=True),
    _cfg("tagger-1f1b", "tagger", "1F1B"),
    _cfg("tagger-zbv", "tagger", "ZBVZeroBubble", "left", user_loss=True),
    # the model's own token mean from `labels=`, no `num_items`: the strategy counts each microbatch's labelled tokens
    _cfg("tagger-bare-zbv", "tagger", "ZBVZeroBubble", bare=True),
    _cfg("qa-1f1b", "qa", "1F1B", user_loss=True),
    _cfg("qa-zbv", "qa", "ZBVZeroBubble"),
    _cfg("reward-from-causal-lm", "reward", "1F1B", directory="reward-causal-lm"),
    _cfg("reward-user-plan-zbv", "reward", "ZBVZeroBubble", model_plan=True),
]
#: the LoRA reward-model recipe (``task_type="SEQ_CLS"``: the head trains whole, in ``modules_to_save``)
LORA_CONFIGS = [
    _cfg("reward-lora-1f1b", "reward", "1F1B", lora=True),
    # a head new to the directory: one device's from_pretrained draws it after loading, in another place of the
    # stream than its construction (docs/initialization.md); this run keeps per-unit values and the reference's order
    {
        **_cfg("reward-lora-from-causal-lm", "reward", "1F1B", lora=True, directory="reward-causal-lm"),
        "init_values": "per_unit",
    },
]
HEAD = "model.base_model.model.score"


@pytest.mark.parametrize(
    "task, head, base",
    [("reward", "score", "model"), ("tagger", "score", "model"), ("qa", "qa_outputs", "transformer")],
)
def test_head_is_a_unit_after_the_final_norm(task, head, base):
    network = getattr(transformers, TASKS[task][0])(config(task))
    layout = hf_layout(network)
    assert layout.pre == (f"{base}.embed_tokens",)
    assert layout.post == (f"{base}.norm", head)
    assert len(layout.blocks) == 4


def test_question_answering_with_another_base_prefix():
    network = transformers.LlamaForQuestionAnswering(config("reward"))  # its base model is `transformer`
    assert hf_layout(network).post == ("transformer.norm", "qa_outputs")


def test_causal_lm_directory_into_a_classifier_is_a_new_head(tmp_path):
    path = save_pretrained(tmp_path / "lm", "classifier", causal_lm=True)
    network = transformers.LlamaForSequenceClassification(config("classifier"))
    directory = hf.read_directory(path)
    assert directory.architectures == ("LlamaForCausalLM",)
    ours, theirs = kind_of(network).new_weights(
        network, directory.architectures, ["score.weight", "model.norm.weight"], directory.files
    )
    assert ours == {"score.weight"} and theirs == {"lm_head.weight"}
    message = hf.new_head_message(path, network, directory, ["model.score.weight"])
    assert "holds a LlamaForCausalLM, not a LlamaForSequenceClassification" in message
    assert "'model.score.weight'" in message and "_init_weights" in message


def test_causal_lm_directory_into_a_lora_classifier_is_a_new_head_and_its_copy():
    peft = pytest.importorskip("peft")
    network = peft.get_peft_model(transformers.LlamaForSequenceClassification(config("reward")), lora_config())
    head = "base_model.model.score"
    missing = [f"{head}.original_module.weight", f"{head}.modules_to_save.default.weight", "base_model.model.model.x"]
    ours, theirs = kind_of(network).new_weights(network, ("LlamaForCausalLM",), missing, ["lm_head.weight"])
    assert ours == set(missing[:2]) and theirs == {"lm_head.weight"}


def test_directory_of_the_same_class_has_no_new_head(tmp_path):
    path = save_pretrained(tmp_path / "cls", "classifier")
    network = transformers.LlamaForSequenceClassification(config("classifier"))
    directory = hf.read_directory(path)
    assert kind_of(network).new_weights(network, directory.architectures, ["score.weight"], directory.files) == (
        set(),
        set(),
    )


def test_one_device_values_under_a_head_new_to_the_directory_are_said_to_differ(tmp_path):
    # init_values='one_device' cannot follow from_pretrained's draw of a head new to the directory: said, with the fix
    path = save_pretrained(tmp_path / "lm", "classifier", causal_lm=True)
    network = transformers.LlamaForSequenceClassification(config("classifier"))
    notice = hf.new_head_notice(path, network)
    assert re.search(r"init_values='one_device'.*LlamaForCausalLM.*LlamaForSequenceClassification.*per_unit", notice)
    assert "(PEFT)" not in notice
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(transformers.LlamaForSequenceClassification(config("reward")), lora_config())
    assert "(PEFT)" in hf.new_head_notice(path, wrapped)
    same = save_pretrained(tmp_path / "cls", "classifier")
    assert hf.new_head_notice(same, network) is None


def _write_directories(work) -> None:
    """The model directories the scenarios fine-tune from, in the launch's folder."""
    for seed, task in enumerate(TASKS):
        save_pretrained(work / task, task, seed=seed)
    save_pretrained(work / "reward-causal-lm", "reward", seed=7, causal_lm=True)


@functools.cache
def reference(path: str, task: str, side: str, user_loss: bool, init_weights: str | None = None, bare: bool = False):
    """Losses, validation losses and probe logits of a single-device fine-tune of the directory: ``from_pretrained``,
    or (``init_weights``) a one-stage pipeline started from that directory."""
    strategy = None if init_weights is None else PipelineParallelStrategy(init_weights=init_weights)
    model, _ = fine_tune(path, task, strategy, side=side, user_loss=user_loss, bare=bare)
    return model.step_losses, model.val_losses, probe(model.model)


SHARED_TWO.part(__name__, "heads", "hf_heads.py", CONFIGS + LORA_CONFIGS, prepare=_write_directories)


@pytest.fixture(scope="module")
def heads(request) -> Launch:
    """The one launch of every config (shared with other modules: tests/launch.py Shared); each test reads its own
    config's outcome."""
    return SHARED_TWO.launch(request)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS, ids=[cfg["name"] for cfg in CONFIGS])
def test_task_head_fine_tunes_and_exports_2_procs(heads, cfg):
    work, task, name = heads.out, cfg["task"], cfg["name"]
    ranks = heads.ranks(name)
    start = str(work / cfg["directory"]) if "directory" in cfg else None
    losses, val_losses, logits = reference(
        str(work / task), task, cfg["side"], cfg["user_loss"], start, cfg.get("bare", False)
    )
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], losses, rtol=TOL, atol=0, msg=name)
    head_names = ("score.weight", "qa_outputs.weight")
    last = next(rank for rank in ranks if any(key.endswith(head_names) for key in rank["state"]))
    assert len(val_losses) == 2
    torch.testing.assert_close(last["val_losses"], val_losses, rtol=TOL, atol=0, msg=name)
    out = export.export(work / f"ckpt-{name}", work / f"export-{name}")
    assert json.loads((out / "config.json").read_text())["architectures"] == [TASKS[task][0]]
    exported = getattr(transformers, TASKS[task][0]).from_pretrained(out, attn_implementation="eager")
    torch.testing.assert_close(probe(exported), logits, rtol=0, atol=TOL, msg=name)


@pytest.mark.extended
@pytest.mark.slow
def test_a_causal_lm_directory_warns_once_of_the_new_head_2_procs(heads):
    warned = [w for w in heads.ranks("reward-from-causal-lm")[0]["warnings"] if "new head" in w]
    assert len(warned) == 1 and "'model.score.weight' are not in it" in warned[0]


@functools.cache
def _lora_one_device(launch: Launch, name: str):
    """A LoRA config's per-rank results and the one-device fine-tune it compares with: ``from_pretrained`` +
    ``get_peft_model`` started from the pipeline's adapters or, from a causal LM's directory, a one-stage pipeline."""
    cfg = next(cfg for cfg in LORA_CONFIGS if cfg["name"] == name)
    ranks = launch.ranks(name)
    initial = {k: v for rank in ranks for k, v in rank["initial"].items()}
    work = launch.out
    values = cfg.get("init_values", "one_device")
    strategy = (
        PipelineParallelStrategy(init_weights=work / cfg["directory"], init_values=values)
        if "directory" in cfg
        else None
    )
    start = None if strategy is not None else initial
    model, _ = fine_tune(work / "reward", "reward", strategy, lora=True, start=start)
    return ranks, model


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("name", [cfg["name"] for cfg in LORA_CONFIGS])
def test_lora_reward_model_2_procs_as_one_device(heads, name):
    """The LoRA reward model at 2 processes against one device (``from_pretrained`` + ``get_peft_model``, started
    from the pipeline's adapters) and, from a causal LM's directory, against a one-stage pipeline (the new head
    initialised, its ``modules_to_save`` copy equal to it); the frozen base unchanged."""
    ranks, model = _lora_one_device(heads, name)
    initial = {k: v for rank in ranks for k, v in rank["initial"].items()}
    frozen = {k: v for rank in ranks for k, v in rank["frozen"].items()}
    assert all(rank["frozen_unchanged"] for rank in ranks), name
    assert torch.equal(initial[f"{HEAD}.modules_to_save.default.weight"], frozen[f"{HEAD}.original_module.weight"])
    if "directory" in next(cfg for cfg in LORA_CONFIGS if cfg["name"] == name):  # the same initial tensors as on two
        assert model.initial.keys() == initial.keys()
        assert all(torch.equal(v, initial[k]) for k, v in model.initial.items()), name
    last = next(rank for rank in ranks if f"{HEAD}.original_module.weight" in rank["frozen"])
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], model.step_losses, rtol=TOL, atol=0, msg=name)
    torch.testing.assert_close(last["val_losses"], model.val_losses, rtol=TOL, atol=0, msg=name)


@pytest.mark.extended
@pytest.mark.slow
def test_lora_reward_model_exports_its_adapters_2_procs(heads):
    """``export-hf --adapter`` of the 2-process LoRA reward model loads with ``PeftModel.from_pretrained`` and gives
    the one-device model's logits."""
    import peft

    from lightning_pipe.checkpoint.__main__ import main

    _, model = _lora_one_device(heads, "reward-lora-1f1b")
    work, out = heads.out, heads.out / "export-reward-lora"
    assert main(["export-hf", str(work / "ckpt-reward-lora-1f1b"), str(out), "--adapter", "--no-progress"]) == 0
    base = transformers.LlamaForSequenceClassification.from_pretrained(work / "reward", attn_implementation="eager")
    loaded = peft.PeftModel.from_pretrained(base, out)
    torch.testing.assert_close(probe(loaded), probe(model.model), atol=TOL, rtol=0)
