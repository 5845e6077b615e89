"""A LightningModule written like a popular project template (its network an ``__init__`` argument kept in
``save_hyperparameters()``, Linear + BatchNorm1d + ReLU, a forward that reshapes its input, ModelCheckpoint) under
the pipeline: what the strategy installs on the user's objects pickles and deep-copies; checkpoints save, resume and
test; one microbatch under GPipe equals one device; two name the BatchNorm layers."""

from __future__ import annotations

import copy
import functools
import io
import pickle
import sys
from types import SimpleNamespace

import pytest
import torch

from lightning_pipe.checkpoint import convert
from lightning_pipe.checkpoint import hparams as ckpt_hparams
from lightning_pipe.checkpoint.io import load_trainer_state
from lightning_pipe.errors import PipelineCheckpointError, PipelineConfigError, PipelineUsageError
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.split.builder import CopiedSplit, split_module
from lightning_pipe.step.interception import CallInterceptor
from lightning_pipe.step.report import batch_arithmetic, batch_dependent_modules
from tests.launch import SHARED_TWO, Launch
from tests.template_models import LitTemplate, SimpleDenseNet, held_out_loader, loaders, new_module, trainer

TOL = 1e-5


def _split_rank0(frontend: str) -> tuple[LitTemplate, CallInterceptor]:
    module = new_module()
    settings = PipelineSettings(frontend=frontend).resolve(2)
    split = split_module(module, settings, pipeline_rank=0, device=torch.device("cpu"))
    return module, CallInterceptor(split.network)


@pytest.mark.parametrize("frontend", ["modules", "dataflow"])
def test_a_split_module_pickles_deep_copies_and_saves_with_its_class_forward(frontend):
    module, interceptor = _split_rank0(frontend)
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    copies = [
        pickle.loads(pickle.dumps(module)),
        copy.deepcopy(module),
        torch.load(buffer, weights_only=False),
    ]
    state = module.state_dict()
    for made in copies:
        assert made.state_dict().keys() == state.keys()
        assert all(torch.equal(made.state_dict()[k], v) for k, v in state.items())
        forward = made.net.__dict__["forward"]
        assert not isinstance(forward, CallInterceptor) and forward.__self__ is made.net
        assert forward.__func__ is SimpleDenseNet.forward
        assert isinstance(made.__dict__["_lightning_pipe_split"], CopiedSplit)
    hparams = pickle.loads(pickle.dumps(dict(module.hparams)))
    assert isinstance(hparams["net"], SimpleDenseNet)
    assert module.net.__dict__["forward"] is interceptor  # the original keeps the interceptor


def test_a_copy_of_a_split_module_is_refused_by_a_new_split():
    module, _ = _split_rank0("dataflow")
    copied = copy.deepcopy(module)
    settings = PipelineSettings(frontend="dataflow").resolve(2)
    with pytest.raises(PipelineUsageError, match=r"copy \(pickled.*pipeline_rank=0.*holds only that rank's units"):
        split_module(copied, settings, pipeline_rank=0, device=torch.device("cpu"))


def test_batch_dependent_modules_are_found_by_their_names():
    assert batch_dependent_modules(SimpleDenseNet(), "net.") == ["net.model.1", "net.model.4"]
    assert batch_dependent_modules(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))) == []


def test_a_refused_pickle_in_trainer_state_names_the_fix(tmp_path):
    torch.save({"hyper_parameters": {"net": SimpleDenseNet()}}, tmp_path / "trainer.pt")
    with pytest.raises(
        PipelineCheckpointError, match=r"SimpleDenseNet.*save_hyperparameters\(\).*FIX.*ignore=\['net'\]"
    ):
        load_trainer_state(tmp_path, None, "FIX")
    assert isinstance(load_trainer_state(tmp_path, False, "FIX")["hyper_parameters"]["net"], SimpleDenseNet)


@pytest.mark.parametrize(
    ("batch", "accumulate", "dp", "world", "parts"),
    [
        (8, 1, 1, 2, ("trains on 8 samples", "data-parallel size is 1 and the world size 2", "2x smaller")),
        (6, 4, 2, 8, ("trains on 48 samples", "accumulate_grad_batches=4", "4 processes of each pipeline")),
        (None, 1, 2, 4, ("the training DataLoader's batch x", "data_parallel_size=2", "2x smaller")),
    ],
)
def test_the_batch_arithmetic_names_the_samples_the_sizes_and_the_divisor(batch, accumulate, dp, world, parts):
    text = batch_arithmetic(batch, accumulate, dp, world)
    assert all(part in text for part in parts) and "`trainer.strategy.data_parallel_size`" in text


def test_the_batch_arithmetic_is_said_on_rank_0_only_when_the_sizes_differ(monkeypatch):
    from lightning_pipe.step import report

    said: list[str] = []
    monkeypatch.setattr(report, "rank_zero_info", said.append)
    fake = SimpleNamespace(train_dataloader=loaders()["train_dataloaders"], accumulate_grad_batches=2)
    report.announce_batch_arithmetic(fake, data_parallel_size=2, world_size=2)  # plain data parallelism: nothing
    assert said == []
    report.announce_batch_arithmetic(fake, data_parallel_size=1, world_size=2)
    assert len(said) == 1 and "16 samples (batches of 8 x accumulate_grad_batches=2" in said[0]


def test_the_hyperparameter_network_is_kept_whole_on_the_meta_device_and_filled_with_the_weights():
    module = new_module()
    ckpt_hparams.record(module)
    split_module(module, PipelineSettings().resolve(2), pipeline_rank=0, device=torch.device("cpu"))
    checkpoint = {"hyper_parameters": dict(module.hparams), "state_dict": {}}
    ckpt_hparams.for_checkpoint(module, checkpoint)
    assert module.hparams["net"] is module.net  # the user's objects are untouched
    kept = checkpoint["hyper_parameters"]["net"]
    assert type(kept) is SimpleDenseNet and "forward" not in kept.__dict__
    assert all(t.is_meta for t in kept.state_dict().values())
    names = checkpoint.pop("hyperparameter_networks")
    assert names["net"]["model.6.weight"] == "net.model.6.weight" and len(names["net"]) == 16
    whole = SimpleDenseNet()
    weights = {f"net.{k}": v for k, v in whole.state_dict().items()}
    hparams = pickle.loads(pickle.dumps(checkpoint["hyper_parameters"]))
    ckpt_hparams.fill(hparams, weights, names)
    assert all(torch.equal(hparams["net"].state_dict()[k], v) for k, v in whole.state_dict().items())
    assert all(isinstance(p, torch.nn.Parameter) for p in hparams["net"].parameters())


def test_a_tied_hyperparameter_network_stays_tied_when_filled():
    import lightning.pytorch as L

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
            self.head.weight = self.embed.weight

    class Holder(L.LightningModule):
        def __init__(self, net: torch.nn.Module) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = net

    module = Holder(Tied())
    ckpt_hparams.record(module)
    checkpoint = {"hyper_parameters": dict(module.hparams)}
    ckpt_hparams.for_checkpoint(module, checkpoint)
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    weights["net.head.weight"] = weights["net.embed.weight"]  # consolidate names a tied tensor under both names
    hparams = checkpoint["hyper_parameters"]
    ckpt_hparams.fill(hparams, weights, checkpoint["hyperparameter_networks"])
    assert hparams["net"].head.weight is hparams["net"].embed.weight
    assert torch.equal(hparams["net"].embed.weight, module.net.embed.weight)


def test_networks_inside_a_list_hyperparameter_are_named_in_a_warning(monkeypatch):
    import lightning.pytorch as L

    class Listed(L.LightningModule):
        def __init__(self, nets: list, sizes: list) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.nets = torch.nn.ModuleList(nets)

    said: list[str] = []
    monkeypatch.setattr(ckpt_hparams, "rank_zero_warn", said.append)
    ckpt_hparams.record(Listed([SimpleDenseNet(), SimpleDenseNet()], [1, 2]))
    (warning,) = said
    assert "'nets'" in warning and "inside a list" in warning and "ignore=['nets']" in warning


def test_filling_a_hyperparameter_network_refuses_missing_weights_and_meta_leftovers():
    net = SimpleDenseNet().to("meta")
    names = {"net": {"model.0.weight": "net.model.0.weight"}}
    with pytest.raises(PipelineCheckpointError, match=r"'net'.*'net\.model\.0\.weight'.*ignore=\['net'\]"):
        ckpt_hparams.fill({"net": net}, {}, names)
    with pytest.raises(PipelineCheckpointError, match=r"'net'.*'model\.0\.bias'.*ignore=\['net'\]"):
        ckpt_hparams.fill({"net": net}, {"net.model.0.weight": torch.zeros(16, 16)}, names)


def test_a_class_that_cannot_be_imported_is_named_with_the_fix(tmp_path, monkeypatch):
    torch.save({"hyper_parameters": {"net": SimpleDenseNet()}}, tmp_path / "trainer.pt")
    monkeypatch.setitem(sys.modules, "tests.template_models", None)  # as if read outside the project
    with pytest.raises(
        PipelineCheckpointError, match=r"`tests\.template_models\.SimpleDenseNet`.*ModuleNotFoundError.*PYTHONPATH"
    ):
        load_trainer_state(tmp_path, False, "FIX")


def test_a_schedule_that_rejects_the_microbatch_count_points_to_gpipe(monkeypatch):
    from lightning_pipe.step.executors import schedule as schedule_module

    runtime = SimpleNamespace(stages={0: torch.nn.Linear(1, 1)}, num_stages=2, device="cpu", group=None)
    settings = SimpleNamespace(schedule="1F1B")

    def refuse(*args, **kwargs):
        raise ValueError("Number of microbatches (1) must be greater than or equal to the number of stages (2).")

    monkeypatch.setattr(schedule_module, "chunk_aware_stage_class", lambda: lambda *a, **k: object())
    monkeypatch.setattr("torch.distributed.pipelining.schedules.get_schedule_class", lambda name: refuse)
    executor = schedule_module.ScheduleExecutor(runtime, settings)
    with pytest.raises(
        PipelineConfigError, match=r"1F1B schedule rejects 1 microbatches for 2 stages.*schedule='GPipe'"
    ):
        executor._schedule(("key",), 1)


# --------------------------------------------------------------------------------------------- multi-process
CONFIGS = [
    {"name": "gpipe-one-microbatch", "schedule": "GPipe", "microbatches": 1},
    {"name": "1F1B-two-microbatches"},  # the defaults: frontend "auto" (dataflow here), 1F1B, 2 microbatches
]


@functools.cache
def _reference(root: str) -> dict:
    from pathlib import Path

    model = new_module()
    first = trainer(Path(root), devices=1)
    first.fit(model, **loaders())
    tested = first.test(model, held_out_loader(), verbose=False)[0]
    resumed = new_module()
    second = trainer(Path(root), devices=1, max_epochs=3)
    second.fit(resumed, ckpt_path=first.checkpoint_callback.last_model_path, weights_only=False, **loaders())
    return {
        "records": model.records,
        "test": tested,
        "resumed_records": resumed.records,
        "resumed_test": second.test(resumed, held_out_loader(), verbose=False)[0],
    }


SHARED_TWO.part(__name__, "runs", "template.py", CONFIGS)


@pytest.fixture(scope="module")
def runs(request) -> Launch:
    return SHARED_TWO.launch(request)  # the 2-process launch shared with other modules (tests/launch.py Shared)


def _same(got, want) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), step
        for key in w:
            assert g[key] == pytest.approx(w[key], rel=TOL, abs=TOL), (step, key)


@pytest.mark.slow
def test_one_microbatch_under_gpipe_fits_checkpoints_resumes_and_tests_like_one_device(runs, tmp_path):
    expected = _reference(str(tmp_path / "reference"))
    for rank in runs.ranks("gpipe-one-microbatch"):
        _same(rank["records"], expected["records"])
        _same([rank["test"]], [expected["test"]])
        _same(rank["resumed_records"], expected["resumed_records"])
        _same([rank["resumed_test"]], [expected["resumed_test"]])
        assert rank["warnings"] == []
        for when in ("during_fit", "after_fit"):
            found = rank[when]
            assert found["copies_equal"] and all(keys == found["state_keys"] for keys in found["copy_keys"])
            assert found["copy_forwards"] == ["method"] * 3 and found["hparams_net"] == "SimpleDenseNet"


@pytest.mark.slow
def test_two_microbatches_warn_once_naming_the_batchnorm_layers_and_the_alternatives(runs):
    ranks = runs.ranks("1F1B-two-microbatches")
    assert ranks[1]["warnings"] == []
    (warning,) = ranks[0]["warnings"]
    for part in (
        "`net.model.1`, `net.model.4`",
        "4-sample microbatches of each 8-sample batch",
        "schedule='GPipe'",
        "microbatches=1",
        "`accumulate_grad_batches` multiplied by 2",
    ):
        assert part in warning
    assert ranks[0]["resumed_test"] == ranks[1]["resumed_test"]


@pytest.mark.slow
def test_rank_0_states_the_samples_per_step_and_the_data_parallel_size_once_at_fit_start(runs):
    ranks = runs.ranks("1F1B-two-microbatches")
    assert ranks[1]["batch_notices"] == []
    (notice,) = ranks[0]["batch_notices"]
    for part in ("8 samples", "data_parallel_size=1", "world size 2", "`trainer.strategy.data_parallel_size`"):
        assert part in notice


@pytest.mark.slow
def test_consolidating_a_checkpoint_holding_the_network_names_trust_pickle_then_loads_it_whole(runs, tmp_path):
    source = runs.out / "gpipe-one-microbatch" / "ckpt" / "last.ckpt"
    # The directory's trainer state holds the network as built, its tensors on the meta device.
    kept = load_trainer_state(source, False, "")["hyper_parameters"]["net"]
    assert type(kept) is SimpleDenseNet and "forward" not in kept.__dict__
    assert all(t.is_meta for t in kept.state_dict().values())
    assert convert.inspect(source)["hyperparameter_networks"] == {"net": 16}  # the names consolidate fills
    with pytest.raises(PipelineCheckpointError, match=r"SimpleDenseNet.*--trust-pickle"):
        convert.consolidate(source, tmp_path / "refused.ckpt")
    target = convert.consolidate(source, tmp_path / "model.ckpt", weights_only=False)
    loaded = LitTemplate.load_from_checkpoint(target, weights_only=False)
    assert type(loaded.net) is SimpleDenseNet and "forward" not in loaded.net.__dict__
    assert sorted(loaded.net.state_dict()) == sorted(SimpleDenseNet().state_dict())
    saved = torch.load(target, weights_only=False)
    hp_state = saved["hyper_parameters"]["net"].state_dict()
    assert all(torch.equal(v, saved["state_dict"][f"net.{k}"]) for k, v in hp_state.items())
    tested = trainer(tmp_path / "eval", devices=1).test(loaded, held_out_loader(), verbose=False)[0]
    # last.ckpt is the resumed run's (third epoch)
    _same([tested], [runs.ranks("gpipe-one-microbatch")[0]["resumed_test"]])


@pytest.mark.slow
def test_consolidate_outside_the_project_names_the_class_it_cannot_import(runs, tmp_path, monkeypatch, capsys):
    from lightning_pipe.checkpoint.__main__ import main

    source = runs.out / "gpipe-one-microbatch" / "ckpt" / "last.ckpt"
    monkeypatch.setitem(sys.modules, "tests.template_models", None)  # as if run where `tests` is not importable
    assert main(["consolidate", "--trust-pickle", "--no-progress", str(source), str(tmp_path / "m.ckpt")]) == 1
    error = capsys.readouterr().err
    assert "`tests.template_models." in error and "ModuleNotFoundError" in error and "PYTHONPATH" in error
    assert not (tmp_path / "m.ckpt").exists()
