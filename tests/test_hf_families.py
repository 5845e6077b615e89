"""Every causal-LM family transformers registers with a pipeline plan (tests/hf_families.py), in the installed
transformers version (CI: the newest 5.x, the test extra's 4.57 and the lowest supported 4.54).

- fast: the families of the multi-process matrix, split into 2 and 4 stages in one process, give the unsplit model's
  logits and gradients;
- slow: every registered family is exact or refused by name with its reason; the matrix trains and validates at 2
  processes under 1F1B and ZBVZeroBubble as on one device (one launch for the whole matrix);
- slow: Gemma 4's and Gemma 3n's text models (per-layer inputs; Gemma 3n's AltUp streams; transformers 5) at 2
  processes in one launch: trained and validated under 1F1B and ZBVZeroBubble as on one device, fine-tuned from a
  ``save_pretrained`` directory and exported.
"""

from __future__ import annotations

import functools

import pytest

transformers = pytest.importorskip("transformers")

from lightning_pipe.errors import PipelineModelError  # noqa: E402
from lightning_pipe.models.huggingface.plan import UNSUPPORTED  # noqa: E402
from tests.hf_families import MATRIX, registry, split_error, unsplit  # noqa: E402
from tests.hf_models import run_hf  # noqa: E402
from tests.hf_pretrained import fine_tune, probe_logits, save_pretrained  # noqa: E402
from tests.launch import SHARED_TWO, Launch, run_script  # noqa: E402
from tests.reference import assert_parity, load_ranks  # noqa: E402

FAMILIES = sorted(registry())
IN_MATRIX = [family for family in MATRIX if family in FAMILIES]
SCHEDULES = ("1F1B", "ZBVZeroBubble")
CONFIGS = [
    {"name": f"{family}-{schedule}", "schedule": schedule, "devices": 2, "family": family, "tie": False}
    | {"side": "right", "layers": 4}
    for family in IN_MATRIX
    if family not in ("gemma4_text", "gemma3n_text")  # these configs run in the per-layer launch (slow tier) below
    for schedule in SCHEDULES
]
TOL = 1e-5


def test_the_matrix_has_at_least_twelve_families():
    assert len(IN_MATRIX) >= 12, IN_MATRIX


@pytest.mark.parametrize("family", IN_MATRIX)
def test_matrix_family_split_is_exact(family):
    assert split_error(family) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_registered_family_is_exact_or_refused_by_name(family):
    try:
        model, _ = unsplit(family)
    except Exception as err:  # the generic tiny config does not fit this family: nothing to pipeline
        pytest.skip(f"the tiny {family} model fails on one device: {type(err).__name__}: {err}")
    try:
        error = split_error(family)
    except PipelineModelError as err:
        message = str(err)
        assert message.startswith(f"{type(model).__name__} (model_type") or f" of {type(model).__name__} " in message
        if family in UNSUPPORTED:
            assert UNSUPPORTED[family] in message
        return
    assert family not in UNSUPPORTED
    assert error < TOL


@functools.cache
def reference(family: str) -> dict:
    return run_hf(family=family, tie=False, side="right", layers=4)


SHARED_TWO.part(__name__, "matrix", "hf.py", CONFIGS, timeout=900)


@pytest.fixture(scope="module")
def matrix(request) -> Launch:
    return SHARED_TWO.launch(request)  # the 2-process launch shared with other modules (tests/launch.py Shared)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c["name"])
def test_family_trains_and_validates_as_on_one_device(matrix, cfg):
    ranks = matrix.ranks(cfg["name"])
    ref = reference(cfg["family"])
    # atol 2e-6: under torch 2.11 and transformers 4.54 on an Intel machine, one of gemma2's 1952 embedding weights
    # (a value of 0.008) ends 1.4e-6 from the one-device run (the microbatches' gradients summed in another order)
    assert_parity(ranks, ref["losses"], ref["state"], rtol=TOL, atol=2e-6)
    for rank in ranks:
        assert rank["metrics"].keys() == ref["metrics"].keys()
        for key, value in ref["metrics"].items():
            assert rank["metrics"][key] == pytest.approx(value, rel=TOL, abs=1e-6), key


PER_LAYER = ("gemma4_text", "gemma3n_text")
"""Families whose layers read per-layer inputs (Gemma 3n also carries AltUp's stack of streams between blocks)."""
#: Per family, the weights the first rank holds and the last rank does not, and the other way round.
FIRST_AND_LAST = {
    "gemma4_text": (["model.model.embed_tokens_per_layer.weight"], []),
    "gemma3n_text": (
        ["model.model.embed_tokens_per_layer.weight", "model.model.altup_projections.0.weight"],
        ["model.model.altup_unembed_projections.0.weight"],
    ),
}


#: transformers 4.x's Gemma 3n leaves its scale buffers to `__init__`, which the meta device loses (refused by name)
LAUNCHED = [
    f for f in PER_LAYER if f in FAMILIES and (f != "gemma3n_text" or int(transformers.__version__.split(".")[0]) >= 5)
]


@pytest.fixture(scope="module")
def per_layer_run(tmp_path_factory):
    families = LAUNCHED
    if not families:
        pytest.skip(f"transformers {transformers.__version__} has none of {PER_LAYER}")
    work = tmp_path_factory.mktemp("per-layer")
    for family in families:
        save_pretrained(work / f"{family}-pretrained", family, tie=True, layers=4)
    run_script("per_layer.py", str(work), *families, nprocs=2, timeout=900)
    return work


def _skip_unlaunched(family: str) -> None:
    if family not in LAUNCHED:
        pytest.skip(f"transformers {transformers.__version__}: {family} is not in the per-layer launch")


def _skip_missing(family: str) -> None:
    if family not in FAMILIES:
        pytest.skip(f"transformers {transformers.__version__} has no {family} family")


@pytest.mark.slow
@pytest.mark.parametrize("family", PER_LAYER)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_per_layer_inputs_train_and_validate_as_on_one_device(per_layer_run, family, schedule):
    _skip_unlaunched(family)
    ranks = load_ranks(per_layer_run, f"{family}-train-{schedule}")
    ref = reference(family)
    assert_parity(ranks, ref["losses"], ref["state"], rtol=TOL, atol=1e-6)
    first, last = FIRST_AND_LAST[family]
    assert all(name in ranks[0]["state"] for name in first)
    last_rank = 0 if schedule == "ZBVZeroBubble" else 1  # a V schedule puts the first and last stages on rank 0
    assert all(name in ranks[last_rank]["state"] for name in last)
    for rank in ranks:
        assert rank["metrics"].keys() == ref["metrics"].keys()
        for key, value in ref["metrics"].items():
            assert rank["metrics"][key] == pytest.approx(value, rel=TOL, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize("family", PER_LAYER)
def test_per_layer_inputs_from_directory_and_export_hf(per_layer_run, family):
    import torch

    from lightning_pipe.checkpoint import hf_export
    from tests.scripts.per_layer import STEPS

    _skip_unlaunched(family)
    path = per_layer_run / f"{family}-pretrained"
    reference_model, _ = fine_tune(path, max_steps=STEPS)
    ranks = [torch.load(per_layer_run / f"{family}-pretrained.rank{r}.pt") for r in range(2)]
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], reference_model.step_losses, rtol=TOL, atol=0)
    # each rank read only its own stages' tensors: the first the per-layer table (and AltUp's projections in)
    first, last = FIRST_AND_LAST[family]
    assert all(name in ranks[0]["keys"] and name not in ranks[1]["keys"] for name in first)
    assert all(name in ranks[1]["keys"] and name not in ranks[0]["keys"] for name in last)
    out = hf_export.export(per_layer_run / f"{family}-ckpt", per_layer_run / f"{family}-export")
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(exported).__name__ == registry()[family][1]
    torch.testing.assert_close(probe_logits(exported), probe_logits(reference_model.model), rtol=0, atol=TOL)


def _tiny(family: str, **overrides):
    _skip_missing(family)
    from tests.hf_families import tiny_config

    config = tiny_config(family, **overrides)
    if overrides.get("num_kv_shared_layers") and getattr(config, "kv_sharing_modes", None) is None:
        pytest.skip(f"transformers {transformers.__version__} shares keys and values through the cache: refused")
    return getattr(transformers, registry()[family][1])(config)


def _tiny_gemma4(**overrides):
    return _tiny("gemma4_text", **overrides)


def test_per_layer_modules_are_units_of_the_first_stage():
    from lightning_pipe.models.huggingface.plan import hf_layout

    layout = hf_layout(_tiny_gemma4())
    assert layout.pre == (
        "model.embed_tokens",
        "model.embed_tokens_per_layer",
        "model.per_layer_model_projection",
        "model.per_layer_projection_norm",
    )


def test_layers_reusing_another_stages_keys_and_values_are_refused():
    import copy

    from lightning_pipe.models.huggingface.plan import hf_layout, hf_placeholder
    from lightning_pipe.models.huggingface.stage import hf_stage_call
    from lightning_pipe.split.partition import stage_units
    from lightning_pipe.split.surgery import prune
    from tests.hf_families import batch

    # layers 2 and 3 reuse the keys and values of layers 0 and 1 (kv_sharing_modes: store, store, reuse, reuse)
    model = _tiny_gemma4(num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 2)
    layout, placeholder = hf_layout(model), hf_placeholder(model)
    first, second = (
        prune(copy.deepcopy(model), keep, layout.units, placeholder) for keep in stage_units(layout, [2, 2])
    )
    sent = hf_stage_call(first, (), batch(), None, True, False)
    with pytest.raises(PipelineModelError, match=r"Layer 2 of Gemma4TextModel.*keys and values.*layer 0"):
        hf_stage_call(second, (), batch(), sent, False, True)


def test_tensor_parallelism_is_refused_for_gemma4_by_its_plan_styles():
    from lightning_pipe.models.huggingface.tensor_parallel import hf_tensor_parallel_plan

    with pytest.raises(PipelineModelError, match=r"Gemma4ForCausalLM uses styles .*'packed_colwise'"):
        hf_tensor_parallel_plan(_tiny_gemma4(), 2)


def test_a_stage_before_a_last_stage_without_blocks_is_refused():
    """The timed split may give the last stage only the head; the stage before it cannot leave the forward."""
    from lightning_pipe.models.huggingface.plan import hf_layout, hf_placeholder
    from lightning_pipe.models.huggingface.stage import hf_stage_call
    from lightning_pipe.split.partition import stage_units
    from lightning_pipe.split.surgery import prune
    from tests.hf_families import batch, build

    model = build("llama")
    layout = hf_layout(model)
    first = prune(model, stage_units(layout, [4, 0])[0], layout.units, hf_placeholder(model))
    with pytest.raises(PipelineModelError, match=r"LlamaForCausalLM.*holds none of its"):
        hf_stage_call(first, (), batch(), None, True, False)


def test_altup_projections_are_units_of_the_first_and_last_stages():
    from lightning_pipe.models.huggingface.plan import hf_layout

    layout = hf_layout(_tiny("gemma3n_text"))
    assert layout.pre[-3:] == tuple(f"model.altup_projections.{i}" for i in range(3))
    assert layout.post == (*(f"model.altup_unembed_projections.{i}" for i in range(3)), "model.norm", "lm_head")


def _split_exact(model, counts):
    """The largest difference of logits and gradients between ``model`` and its split into ``counts`` blocks per
    stage, chained in one process."""
    import copy

    import torch

    from lightning_pipe.models.huggingface.plan import hf_layout, hf_placeholder
    from lightning_pipe.models.huggingface.stage import hf_stage_call
    from lightning_pipe.split.partition import stage_units
    from lightning_pipe.split.surgery import prune
    from tests.hf_families import batch

    expected = model(**batch(), use_cache=False)
    expected.loss.backward()
    layout, placeholder = hf_layout(model), hf_placeholder(model)
    stages = [prune(copy.deepcopy(model), keep, layout.units, placeholder) for keep in stage_units(layout, counts)]
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    sent, received = [], None
    for i, stage in enumerate(stages):
        out = hf_stage_call(stage, (), batch(), received, i == 0, i == len(stages) - 1)
        if i < len(stages) - 1:
            received = tuple(t.detach().requires_grad_(True) for t in out)
            sent.append((out, received))
    out.loss.backward()
    for values, got in reversed(sent):
        torch.autograd.backward(values, [t.grad for t in got])
    grads = {name: p.grad for stage in stages for name, p in stage.named_parameters() if p.grad is not None}
    worst = (out.logits - expected.logits).abs().max().item()
    for name, param in model.named_parameters():
        if param.grad is not None:
            worst = max(worst, (grads[name] - param.grad).abs().max().item())
    return worst


def test_gemma3n_layers_sharing_keys_and_values_stay_with_their_source_in_a_balanced_split():
    from lightning_pipe.models.huggingface.plan import hf_layout
    from lightning_pipe.split.partition import balance_blocks, keep_together

    # layers 2 and 3 reuse layer 1's keys and values; two layers with activation sparsity
    model = _tiny("gemma3n_text", num_kv_shared_layers=2, activation_sparsity_pattern=[0.95, 0.0, 0.95, 0.0])
    layout = hf_layout(model)
    assert layout.together == ((1, 3),)
    counts = keep_together(balance_blocks(4, 2), layout.together)
    assert counts == [1, 3]
    assert _split_exact(model, counts) < TOL


def test_gemma3n_layers_sharing_keys_and_values_split_from_their_source_are_refused():
    model = _tiny("gemma3n_text", num_kv_shared_layers=2)
    with pytest.raises(PipelineModelError, match=r"Layer 2 of Gemma3nTextModel.*layer 1.*num_kv_shared_layers=2"):
        _split_exact(model, [1, 1, 1, 1])


def test_tensor_parallelism_is_refused_for_gemma3n_naming_its_activation_sparsity():
    from lightning_pipe.models.huggingface.tensor_parallel import hf_tensor_parallel_plan

    model = _tiny("gemma3n_text", activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0])
    with pytest.raises(
        PipelineModelError, match=r"Gemma3nForCausalLM.*activation_sparsity_pattern.*0\.95.*tensor_parallel=1"
    ):
        hf_tensor_parallel_plan(model, 2)


def test_gemma3n_stages_run_whole_backward_passes():
    from lightning_pipe.models import kind_of
    from tests.hf_families import build

    assert kind_of(_tiny("gemma3n_text")).stage_call.full_backward(0)
    assert kind_of(_tiny("gemma3n_text")).stage_call is kind_of(_tiny("gemma3n_text")).stage_call
    assert not hasattr(kind_of(build("llama")).stage_call, "full_backward")


def test_gemma3n_sharing_keys_and_values_through_the_cache_is_refused():
    """transformers 4.x's Gemma 3n shares keys and values only through the decoding cache."""
    from lightning_pipe.models.huggingface.plan import hf_layout
    from tests.hf_families import tiny_config

    _skip_missing("gemma3n_text")
    config = tiny_config("gemma3n_text", num_kv_shared_layers=2)
    if getattr(config, "kv_sharing_modes", None) is not None:
        pytest.skip(f"transformers {transformers.__version__} shares them without the cache")
    model = getattr(transformers, registry()["gemma3n_text"][1])(config)
    with pytest.raises(PipelineModelError, match=r"Gemma3nTextModel.*num_kv_shared_layers=2.*transformers>=5"):
        hf_layout(model)


def test_a_peft_model_around_gemma3n_runs_whole_backward_passes():
    peft = pytest.importorskip("peft")
    from lightning_pipe.models import kind_of

    model = peft.get_peft_model(_tiny("gemma3n_text"), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert kind_of(model).name.startswith("peft")
    assert kind_of(model).stage_call.full_backward(0)
