"""Checkpoints: pure format checks (single process), and multi-process save/resume/reshard/convert/kill scenarios."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F

from lightning_pipe import PipelineCheckpointError, PipelineParallelStrategy
from lightning_pipe.checkpoint import convert, io, optim, save
from lightning_pipe.checkpoint import format as fmt
from lightning_pipe.checkpoint.__main__ import main as cli
from tests.launch import agreed_errors, run_script
from tests.models import VOCAB
from tests.scripts.ckpt_common import LitLMScheduled

# ---------------------------------------------------------------------------------------------------- format (pure)


def test_transient_names_and_leftovers(tmp_path):
    ckpt = tmp_path / "last.ckpt"
    assert fmt.temporary_path(ckpt, "ab12").name == "last.ckpt.tmp-ab12"
    assert fmt.replaced_path(ckpt, "ab12").name == "last.ckpt.old-ab12"
    assert fmt.is_transient(fmt.trash_path(ckpt, "ab12")) and not fmt.is_transient(ckpt)
    for name in ("last.ckpt.tmp-01", "last.ckpt.trash-02", "last.ckpt.old-03", "last-v1.ckpt.tmp-04"):
        (tmp_path / name).mkdir()
    assert [p.name for p in fmt.leftovers(ckpt)] == ["last.ckpt.tmp-01", "last.ckpt.trash-02"]


def test_missing_checkpoint_points_at_interrupted_replacement(tmp_path):
    ckpt = tmp_path / "last.ckpt"
    with pytest.raises(PipelineCheckpointError, match=r"does not exist\.$"):
        fmt.read_manifest(ckpt)
    (tmp_path / "last.ckpt.old-0f").mkdir()
    with pytest.raises(PipelineCheckpointError, match=r"previous complete checkpoint to .*last\.ckpt\.old-0f.*rename"):
        fmt.read_manifest(ckpt)


def test_manifest_errors(tmp_path):
    with pytest.raises(
        PipelineCheckpointError,
        match=r"x\.ckpt\.tmp-1a' is a temporary directory.*interrupted save.*without the '\.tmp-1a' suffix",
    ):
        fmt.read_manifest(tmp_path / "x.ckpt.tmp-1a")
    with pytest.raises(PipelineCheckpointError, match="has no lightning_pipe.json"):
        fmt.read_manifest(tmp_path)
    (tmp_path / fmt.MANIFEST).write_text("{not json")
    with pytest.raises(PipelineCheckpointError, match="manifest .* is corrupted"):
        fmt.read_manifest(tmp_path)
    (tmp_path / fmt.MANIFEST).write_text(json.dumps({"format": "other"}))
    with pytest.raises(PipelineCheckpointError, match="is not a lightning-pipe manifest"):
        fmt.read_manifest(tmp_path)
    manifest = fmt.build_manifest(
        pipeline_size=2,
        data_parallel_size=1,
        stages_per_rank=1,
        schedule="1F1B",
        optimizers=1,
        lr_schedulers=True,
        module_class="m.M",
    )
    (tmp_path / fmt.MANIFEST).write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(PipelineCheckpointError, match="format version 99; this lightning-pipe reads version 1"):
        fmt.read_manifest(tmp_path)
    (tmp_path / fmt.MANIFEST).write_text(json.dumps(manifest))
    assert fmt.read_manifest(tmp_path)["lr_scheduler_files"] == ["lr_schedulers/rank0.pt", "lr_schedulers/rank1.pt"]


def test_missing_files_finds_missing_and_truncated(tmp_path):
    manifest = {"lr_scheduler_files": ["lr_schedulers/rank0.pt"]}
    (tmp_path / fmt.TRAINER_STATE).write_bytes(b"x")
    (tmp_path / "__0_0.distcp").write_bytes(b"x" * 10)
    problems = fmt.missing_files(tmp_path, manifest, [("__0_0.distcp", 8), ("__0_0.distcp", 20), ("__1_0.distcp", 4)])
    assert problems == [
        ".metadata is missing",
        "lr_schedulers/rank0.pt is missing",
        "shard __0_0.distcp is truncated (10 of 20 bytes)",
        "shard __1_0.distcp is missing",
    ]


def test_key_problems_reports_weights_first_then_optimizers_and_shapes():
    expected = {
        "state_dict.a.w": (2, 3),
        "state_dict.b": (4,),
        "optimizer_0.param_groups.a.w.lr": None,
    }
    stored = {"state_dict.b": (5,)}
    assert fmt.key_problems(expected, stored) == [
        "missing weights: 'a.w'",
        "missing optimizer 0 state: 'optimizer_0.param_groups.a.w.lr'",
        "shape mismatch: 'b' is [5] in the checkpoint but [4] in the model",
    ]
    assert fmt.key_problems({"state_dict.b": (5,)}, stored) == []
    assert fmt.format_keys([f"k{i}" for i in range(8)], limit=2) == "'k0', 'k1' and 6 more"


def test_unexpected_keys_and_weight_key_matching():
    assert fmt.unexpected_keys(["state_dict.a", "state_dict.b", "optimizer_0.x"], ["state_dict.a"]) == ["state_dict.b"]
    expected = ["model.layers.0.w", "model.head.w"]
    assert (
        fmt.match_weight_keys(expected, ["model.layers.0.w", "model.head.w"], "model.")["model.head.w"]
        == "model.head.w"
    )
    # pretrained weights of the network alone lack the LightningModule's attribute prefix
    assert fmt.match_weight_keys(expected, ["layers.0.w", "head.w"], "model.")["model.head.w"] == "head.w"
    assert fmt.match_weight_keys(expected, ["layers.0.w"], "")["model.head.w"] == "model.head.w"


def test_scheduler_source_and_same_state():
    manifest = {"pipeline_size": 4}
    assert fmt.scheduler_source(manifest, 3, 4) == "lr_schedulers/rank3.pt"
    assert fmt.scheduler_source(manifest, 1, 2) == "lr_schedulers/rank0.pt"
    a = {"base_lrs": [0.1], "t": torch.ones(2), "n": 3}
    assert fmt.same_state(a, {"base_lrs": [0.1], "t": torch.ones(2), "n": 3})
    assert not fmt.same_state(a, {"base_lrs": [0.2], "t": torch.ones(2), "n": 3})
    assert not fmt.same_state(a, {"base_lrs": [0.1], "t": torch.zeros(2), "n": 3})


# ---------------------------------------------------------------------------------------------------- optimizer state


def _stepped_adam(groups: bool = False):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    params = (
        [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[1].parameters(), "lr": 0.2}]
        if groups
        else model.parameters()
    )
    opt = torch.optim.Adam(params, lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return model, opt


def test_optimizer_flatten_round_trip_by_name():
    torch.manual_seed(0)
    model, opt = _stepped_adam(groups=True)
    names = optim.param_names(model)
    flat = optim.flatten(opt, names)
    assert flat["param_groups.1.weight.lr"] == 0.2 and flat["state.0.bias.exp_avg"].shape == (4,)
    other, fresh = _stepped_adam(groups=True)
    fresh.state.clear()
    native = optim.unflatten(fresh, optim.param_names(other), flat)
    fresh.load_state_dict(native)
    for p, q in zip(model.parameters(), fresh.param_groups[0]["params"] + fresh.param_groups[1]["params"]):
        assert torch.equal(opt.state[p]["exp_avg_sq"], fresh.state[q]["exp_avg_sq"])
    assert [g["lr"] for g in fresh.param_groups] == [0.1, 0.2]


def test_flatten_does_not_step_a_fresh_optimizer():
    # torch's get_optimizer_state_dict takes a zero-lr step here: Adam's step count would become 1.
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    flat = optim.flatten(opt, optim.param_names(model))
    assert not opt.state and not any(k.startswith("state.") for k in flat)
    assert optim.missing_params(opt, optim.param_names(model), flat) == []


def test_unflatten_refuses_regrouped_parameters():
    model, opt = _stepped_adam(groups=True)
    flat = optim.flatten(opt, optim.param_names(model))
    single = torch.optim.Adam(model.parameters())
    with pytest.raises(
        PipelineCheckpointError,
        match=r"different 'lr' values \(0\.1 and 0\.2 for '1\.weight'\).*`configure_optimizers`.*Group them",
    ):
        optim.unflatten(single, optim.param_names(model), flat)


def test_optimizer_over_foreign_parameters_is_refused():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    with pytest.raises(PipelineCheckpointError, match="not in the LightningModule"):
        optim.flatten(opt, optim.param_names(model))


# ---------------------------------------------------------------------------------------------------- io (one process)


def test_remove_renames_before_deleting_and_refuses_transient(tmp_path):
    ckpt = tmp_path / "epoch=0.ckpt"
    (ckpt / "sub").mkdir(parents=True)
    link = tmp_path / "last.ckpt"
    os.symlink(ckpt, link)
    save.remove(link, "aa")
    assert not link.exists() and ckpt.is_dir()  # a link goes, not what it points at
    save.remove(ckpt, "bb")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(PipelineCheckpointError, match=r"Refusing to remove '.*x\.ckpt\.tmp-12'.*in progress"):
        save.remove(tmp_path / "x.ckpt.tmp-12", "cc")


def test_commit_replaces_previous_only_after_rename(tmp_path):
    path, tmp = tmp_path / "last.ckpt", tmp_path / "last.ckpt.tmp-1"
    path.mkdir()
    (path / "old").write_text("old")
    tmp.mkdir()
    (tmp / "new").write_text("new")
    save.commit(tmp, path, "1", {"format": fmt.FORMAT_NAME})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"] and (path / "new").exists()
    assert (path / fmt.MANIFEST).is_file()  # written before the rename


def test_load_weights_errors_single_process(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    topo = io.Topology(0, 1, 0, 1, 0, 1, 1, "1F1B")
    with pytest.raises(PipelineCheckpointError, match="(?s)Cannot read weights from .*does not exist"):
        io.load_weights(tmp_path / "nope.pt", topo, model, network_prefix="", strict=True)
    torch.save({"0.weight": torch.zeros(3, 2), "0.bias": torch.zeros(2)}, tmp_path / "w.pt")
    with pytest.raises(PipelineCheckpointError, match=r"(?s)shape mismatch: '0.weight' is \[3, 2\] .* but \[2, 2\]"):
        io.load_weights(tmp_path / "w.pt", topo, model, network_prefix="", strict=True)
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(PipelineCheckpointError, match="(?s)expected a Lightning checkpoint .* got list"):
        io.load_weights(tmp_path / "list.pt", topo, model, network_prefix="", strict=True)
    torch.save({"0.weight": torch.ones(2, 2), "0.bias": torch.ones(2), "1.weight": torch.ones(1)}, tmp_path / "x.pt")
    with pytest.raises(PipelineCheckpointError, match=r"x\.pt'.*does not have: '1\.weight'.*`strict_loading = False`"):
        io.load_weights(tmp_path / "x.pt", topo, model, network_prefix="", strict=True)
    io.load_weights(tmp_path / "x.pt", topo, model, network_prefix="", strict=False)
    assert torch.equal(model[0].weight, torch.ones(2, 2))


def test_save_checkpoint_rejects_storage_options():
    with pytest.raises(TypeError, match="storage_options=...\\)` is not supported"):
        PipelineParallelStrategy().save_checkpoint({}, "x.ckpt", storage_options={"a": 1})


def test_cli_reports_errors(tmp_path, capsys):
    assert cli(["inspect", str(tmp_path / "missing.ckpt")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert cli(["consolidate", str(tmp_path), str(tmp_path / "out.ckpt")]) == 1
    assert "has no lightning_pipe.json" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- multi-process


def _load(out: Path, name: str, ranks: int = 2) -> list[dict]:
    return [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(ranks)]


def _merged(parts: list[dict], key: str) -> dict:
    merged: dict = {}
    for part in parts:
        assert not set(merged) & set(part[key]), "two ranks hold the same entry"
        merged.update(part[key])
    return merged


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert fmt.same_state(a[k], b[k]), k


def _batch_loss(model: L.LightningModule, index: int) -> float:
    x, y = model.train_dataloader().dataset[8 * index : 8 * (index + 1)]
    with torch.no_grad():
        return float(F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """ckpt_train.py: straight runs and checkpoints after epoch 1 (3 of 9 steps), 1F1B and Interleaved1F1B."""
    out = tmp_path_factory.mktemp("ckpt")
    run_script("ckpt_train.py", str(out), nprocs=2, launcher="torchrun")
    return out


@pytest.mark.slow
def test_resume_reshard_convert_and_errors(trained):
    out = trained
    straight = {name: _load(out, f"{name}-straight")[0]["losses"] for name in ("1f1b", "interleaved")}
    saved = {name: _load(out, f"{name}-saved") for name in ("1f1b", "interleaved")}

    # ModelCheckpoint(save_top_k=1) removed the worse directories; no save leftovers.
    assert [p.name for p in (out / "topk").iterdir()] == [Path(saved["1f1b"][0]["best"]).name]
    assert not [p for p in out.rglob("*") if fmt.is_transient(p)]

    # Convert: the single file holds the saved weights; on one device it predicts what the pipeline predicted, and
    # gives the pipeline's next-step loss.
    convert.consolidate(out / "interleaved.ckpt", out / "single.ckpt")
    single = LitLMScheduled.load_from_checkpoint(out / "single.ckpt")
    _assert_same_state(single.state_dict(), _merged(saved["interleaved"], "state"))
    pipeline_predictions = torch.load(out / "interleaved-predictions.pt")
    with torch.no_grad():
        single_predictions = single.eval()(single.train_dataloader().dataset.tensors[0])
    assert pipeline_predictions.shape == (24, 6, VOCAB)
    torch.testing.assert_close(single_predictions, pipeline_predictions, rtol=1e-5, atol=1e-6)
    assert _batch_loss(single, 0) == pytest.approx(straight["interleaved"][3], abs=1e-6)

    # Reverse direction: pretrained weights of the network alone, and the expected single-device first loss.
    L.seed_everything(5)
    pretrained = LitLMScheduled()
    torch.save(pretrained.model.state_dict(), out / "pretrained.pt")
    reference_first_loss = _batch_loss(pretrained, 0)

    src = out / "interleaved.ckpt"
    for name in ("truncated", "no-manifest", "no-scheduler", "no-trainer-state"):
        shutil.copytree(src, out / f"corrupt-{name}.ckpt")
    shard = out / "corrupt-truncated.ckpt" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    (out / "corrupt-no-manifest.ckpt" / fmt.MANIFEST).unlink()
    (out / "corrupt-no-scheduler.ckpt" / "lr_schedulers" / "rank1.pt").unlink()
    (out / "corrupt-no-trainer-state.ckpt" / fmt.TRAINER_STATE).unlink()
    shutil.copytree(src, out / "corrupt-truncated.ckpt.tmp-0a1b")

    run_script("ckpt_resume.py", str(out), nprocs=2, launcher="torchrun")

    # Resume exactness in a new process group: steps 4..9 equal the uninterrupted run's, bitwise. Exact by
    # construction: the same schedule, layout, process count and thread count (1, tests/launch.py) run the same ops
    # on the same restored state.
    for name in ("1f1b", "interleaved"):
        resumed = _load(out, f"{name}-resumed")
        assert resumed[0]["losses"] == straight[name][3:], name
        assert resumed[0]["global_step"] == 3
        _assert_same_state(_merged(resumed, "state"), _merged(saved[name], "state"))
        _assert_same_state(_merged(resumed, "optim"), _merged(saved[name], "optim"))
        assert resumed[0]["schedulers"] == saved[name][0]["schedulers"]

    # Reshard: 2 ranks x 2 stages saved, 2 ranks x 1 stage loaded: every weight and Adam moment exactly; the
    # schedules' reduction orders differ, so later losses agree to 1e-6.
    reshard = _load(out, "reshard-resumed")
    _assert_same_state(_merged(reshard, "state"), _merged(saved["interleaved"], "state"))
    _assert_same_state(_merged(reshard, "optim"), _merged(saved["interleaved"], "optim"))
    assert reshard[0]["losses"] == pytest.approx(straight["interleaved"][3:], abs=1e-6)

    # Initial weights: plain network state dict, consolidated .ckpt, weights-only directory. The weights are copies
    # (exact); the first loss is not: these runs use 1F1B (2 stages, 2 microbatches), the straight run
    # Interleaved1F1B (4 stages, 4 microbatches), so the loss is averaged in another order (seen 8e-8 apart).
    assert _load(out, "init-plain")[0]["losses"][0] == pytest.approx(reference_first_loss, abs=1e-6)
    for name in ("init-ckpt", "init-dir"):
        parts = _load(out, name)
        _assert_same_state(_merged(parts, "state"), _merged(saved["interleaved"], "state"))
        assert parts[0]["losses"][0] == pytest.approx(straight["interleaved"][3], rel=1e-6)

    errors = agreed_errors(out)
    expected = {
        "fewer-layers": r"holds weights the model does not have: 'model\.layers\.6\..*strict_loading",
        "more-layers": r"missing weights: 'model\.layers\.8\..*no state for optimizer 0's parameters",
        "truncated": r"incomplete or corrupted: shard __1_0\.distcp is truncated \(1000 of \d+ bytes\)",
        "no-manifest": r"has no lightning_pipe\.json",
        "no-scheduler": r"lr_schedulers/rank1\.pt is missing",
        "no-trainer-state": r"trainer\.pt is missing",
        "tmp-dir": r"temporary directory of an interrupted save",
        "weights-only": r"0 optimizer\(s\) .* saved with weights only.*init_weights=",
        "single-file-fit": r"single-file checkpoint without optimizer state .*init_weights=",
        "init-other-model": r"pretrained\.pt' holds weights the model does not have: 'layers\.6\.",
        "init-missing": r"does-not-exist\.pt' does not exist",
    }
    assert errors.keys() == expected.keys()
    for name, pattern in expected.items():
        with pytest.raises(PipelineCheckpointError, match="(?s)" + pattern):
            raise PipelineCheckpointError(errors[name])


@pytest.mark.slow
def test_single_device_loads_pipeline_checkpoint(trained):
    run_script("ckpt_single.py", str(trained), nprocs=1, launcher="lightning")
    (single,) = _load(trained, "single-resumed", ranks=1)
    saved = _load(trained, "interleaved-saved")
    _assert_same_state(single["state"], _merged(saved, "state"))
    _assert_same_state(single["optim"], _merged(saved, "optim"))
    straight = _load(trained, "interleaved-straight")[0]["losses"]
    assert single["losses"] == pytest.approx(straight[3:], abs=1e-6)


@pytest.mark.extended
@pytest.mark.slow
def test_rank_killed_mid_save_leaves_previous_checkpoint_resumable(tmp_path):
    proc = run_script("ckpt_kill.py", str(tmp_path), "crash", nprocs=2, launcher="torchrun", expect_failure=True)
    # rank 1 died of SIGKILL: torchrun's report names it as the root cause or among the other failures, by whichever
    # it saw first (rank 0 ends at once on the lost connection, and its error file can carry the earlier time stamp)
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*\n\s*exitcode\s*: -9 ", proc.stderr), proc.stderr[-3000:]
    ckpts = tmp_path / "kill"
    leftovers = sorted(p.name for p in ckpts.iterdir() if fmt.is_transient(p))
    # The interrupted save, and the epoch's other save, which waited for its resume point (taken when training goes
    # on, docs/checkpoints.md#atomic-saves): neither was renamed into place.
    assert len(leftovers) == 2 and leftovers[0].startswith("epoch=1-step=6.ckpt.tmp-")
    assert leftovers[1].startswith("last.ckpt.tmp-") and not (ckpts / "epoch=1-step=6.ckpt").exists()
    assert torch.load(ckpts / "last.ckpt" / fmt.TRAINER_STATE, weights_only=False)["global_step"] == 3

    run_script("ckpt_kill.py", str(tmp_path), "resume", nprocs=2, launcher="torchrun")
    resumed = _load(tmp_path, "kill-resumed")[0]
    assert resumed["global_step"] == 3
    assert not [p for p in ckpts.iterdir() if fmt.is_transient(p)]  # the next save of last.ckpt cleaned up
    L.seed_everything(0)
    # Uninterrupted reference, from the same seed on one device: 1e-6 (single device vs 1F1B reduction order).
    reference = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = LitLMScheduled()
    reference.fit(model)
    assert resumed["losses"] == pytest.approx(model.step_losses[3:], abs=1e-6)
