"""``model_plan``: the pipeline plan a user gives for a transformers family without one. Validated when the strategy
is made (each bad key or value named), installed where transformers keeps a family's own plan (so the split, the
stages and ``save_pretrained`` treat it as theirs), and refused on a model that has a plan of its own or for a
network that is not a transformers model. Its 2-process parity with one device is in tests/test_hf_heads.py."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_pipe import PipelineParallelStrategy  # noqa: E402
from lightning_pipe.errors import PipelineConfigError, PipelineModelError  # noqa: E402
from lightning_pipe.models import use_plan  # noqa: E402
from lightning_pipe.models.huggingface.plan import hf_layout  # noqa: E402
from lightning_pipe.settings import PipelineSettings  # noqa: E402
from tests.hf_heads import USER_PLAN, config, without_plan  # noqa: E402


@pytest.fixture
def classifier():
    with without_plan():
        yield transformers.LlamaForSequenceClassification(config("reward"))


def test_without_a_plan_the_refusal_names_model_plan(classifier):
    with pytest.raises(
        PipelineModelError,
        match=r"LlamaForSequenceClassification.*no pipeline plan.*`PipelineParallelStrategy\(model_plan=",
    ):
        hf_layout(classifier)


def test_the_user_plan_cuts_the_model_and_save_pretrained_omits_it(classifier, tmp_path):
    plan = PipelineSettings(model_plan=USER_PLAN).model_plan
    use_plan(classifier, plan)
    use_plan(classifier, plan)  # again (the tuner, then the split): nothing changes
    layout = hf_layout(classifier)
    assert layout.pre == ("model.embed_tokens",) and layout.post == ("model.norm", "score")
    assert layout.blocks == tuple(f"model.layers.{i}" for i in range(4))
    assert classifier.config.base_model_pp_plan["layers"] == (["hidden_states", "attention_mask"], ["hidden_states"])
    classifier.save_pretrained(tmp_path)
    assert "base_model_pp_plan" not in (tmp_path / "config.json").read_text()


def test_a_model_with_its_own_plan_is_refused():
    network = transformers.LlamaForSequenceClassification(config("reward"))
    use_plan(network, USER_PLAN)  # the same plan as transformers': nothing to choose
    other = {**USER_PLAN, "model.layers": (["hidden_states"], ["hidden_states"])}
    with pytest.raises(PipelineConfigError, match=r"`model_plan` was given, but LlamaForSequenceClassification has a"):
        use_plan(network, other)


def test_a_name_the_model_lacks_is_refused(classifier):
    plan = {**USER_PLAN, "model.final_norm": (["hidden_states"], ["hidden_states"])}
    with pytest.raises(PipelineConfigError, match=r"names \['model.final_norm'\], which LlamaForSequence"):
        use_plan(classifier, plan)


def test_a_plain_module_is_refused():
    with pytest.raises(
        PipelineConfigError,
        match=r"`model_plan` describes a transformers model.*plain module \(Sequential\).*Drop `model_plan`.*`blocks=`",
    ):
        use_plan(torch.nn.Sequential(torch.nn.Linear(2, 2)), USER_PLAN)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({}, r"`model_plan` must be a non-empty dict .* got \{\}"),
        ("model.layers", r"`model_plan` must be a non-empty dict .* got 'model.layers'"),
        ({"model..layers": (["h"], ["h"])}, r"`model_plan` key 'model..layers' is not a module name"),
        ({"model.layers": ["hidden_states"]}, r"`model_plan\['model.layers'\]` is \['hidden_states'\]; it must be"),
        ({"model.layers": (["h"], "h")}, r"`model_plan\['model.layers'\]` is \(\['h'\], 'h'\); it must be"),
    ],
)
def test_bad_plans_are_refused_when_the_strategy_is_made(plan, message):
    with pytest.raises(PipelineConfigError, match=message):
        PipelineParallelStrategy(model_plan=plan)


def test_the_fabric_strategy_takes_the_same_plan():
    import lightning_pipe

    strategy = lightning_pipe.PipelineFabricStrategy(model_plan=USER_PLAN)
    assert strategy.settings.model_plan == USER_PLAN
    with pytest.raises(PipelineConfigError, match=r"`model_plan\['score'\]` is \['hidden_states'\]"):
        lightning_pipe.PipelineFabricStrategy(model_plan={**USER_PLAN, "score": ["hidden_states"]})
