"""From one device to the pipeline and back, mid-training: optimizer state between torch's native form (parameters by
position) and the pipeline's name-keyed form. Pure mapping functions (single process), single-process resumes and
consolidations of hand-built checkpoints, and one 2-process launch with single-device runs beside it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from torch import nn

from lightning_pipe import PipelineCheckpointError
from lightning_pipe.checkpoint import convert, io, optim
from lightning_pipe.checkpoint import format as fmt
from lightning_pipe.checkpoint.__main__ import main as cli
from tests.launch import agreed_errors, run_script
from tests.scripts.ckpt_common import LitLMScheduled, Snapshot, snapshot, trainer

# ---------------------------------------------------------------------------------------------------- helpers


def _decay_groups(module: nn.Module, lr: float = 0.1) -> list[dict]:
    """Weight decay on weights only, selected by name: the same grouping on any subset of the parameters."""
    named = list(module.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0, "lr": lr / 2},
    ]


def _trained(steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(_decay_groups(model), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.8**step)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 3)).sum().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def _layout(model: nn.Module, opt: torch.optim.Optimizer) -> optim.ParamGroups:
    names = optim.param_names(model)
    return [[[names[id(p)] for p in g["params"]] for g in opt.param_groups]]


def _stage(model: nn.Sequential, keep: list[int]) -> nn.Sequential:
    """A pipeline rank's view of ``model``: the other units replaced, names unchanged."""
    stage = copy.deepcopy(model)
    for i in range(len(stage)):
        if i not in keep:
            stage[i] = nn.Identity()
    return stage


# ---------------------------------------------------------------------------------------------------- pure mapping


class _Module(nn.Module):
    def __init__(self, conf) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)
        self._conf = conf

    def configure_optimizers(self):
        return self._conf(self)


@pytest.mark.parametrize(
    "conf",
    [
        lambda m: [torch.optim.SGD(m.a.parameters(), lr=1), torch.optim.Adam(m.b.parameters())],
        lambda m: ([torch.optim.SGD(m.a.parameters(), lr=1), torch.optim.Adam(m.b.parameters())], []),
        lambda m: (
            {"optimizer": torch.optim.SGD(m.a.parameters(), lr=1)},
            {"optimizer": (o := torch.optim.Adam(m.b.parameters())), "lr_scheduler": {"scheduler": _lambda_lr(o)}},
        ),
    ],
    ids=["list", "optimizers-and-schedulers", "dicts"],
)
def test_full_param_groups_reads_every_configure_optimizers_format(conf):
    with torch.device("meta"):  # nothing is allocated
        module = _Module(conf)
    assert optim.full_param_groups(module) == [[["a.weight", "a.bias"]], [["b.weight", "b.bias"]]]


def _lambda_lr(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


def test_full_param_groups_of_groups_foreign_parameters_and_no_optimizer():
    foreign = nn.Parameter(torch.ones(1))
    module = _Module(lambda m: {"optimizer": torch.optim.Adam([*_decay_groups(m), {"params": [foreign]}])})
    assert optim.full_param_groups(module) == [[["a.weight", "b.weight"], ["a.bias", "b.bias"], [None]]]
    assert optim.full_param_groups(_Module(lambda m: None)) == []


def test_record_param_groups_keeps_them_and_lets_the_users_error_through():
    module = _Module(lambda m: torch.optim.SGD(m.parameters(), lr=1))
    assert optim.recorded_param_groups(module) is None
    optim.record_param_groups(module)
    assert optim.recorded_param_groups(module) == [[["a.weight", "a.bias", "b.weight", "b.bias"]]]

    def broken(m):
        raise KeyError("needs the trainer")

    module._conf = broken
    # The user's own error, its type and traceback kept, with a note saying why the strategy called the hook.
    with pytest.raises(KeyError, match="needs the trainer") as caught:
        optim.record_param_groups(module)
    assert "calls once on the full model before it splits it" in "".join(caught.value.__notes__)
    assert caught.traceback[-1].name == "broken"
    assert optim.recorded_param_groups(module) is None


def test_localize_and_to_native_round_trip_across_two_ranks():
    model, opt, _ = _trained()
    native, layout = opt.state_dict(), _layout(model, opt)
    flat: dict = {}
    for keep in ([0, 1], [2]):
        stage = _stage(model, keep)
        stage_opt = torch.optim.AdamW(_decay_groups(stage), lr=0.1)
        names = optim.param_names(stage)
        stage_opt.load_state_dict(optim.localize(native, layout[0], optim.ordered_names(stage_opt, names), 0))
        full = dict(model.named_parameters())
        for name, p in stage.named_parameters():  # copies: exactly equal
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(stage_opt.state[p][key], opt.state[full[name]][key]), (name, key)
        # hyperparameters as the scheduler left them, per group
        assert [g["lr"] for g in stage_opt.param_groups] == [g["lr"] for g in opt.param_groups]
        assert [g["initial_lr"] for g in stage_opt.param_groups] == [0.1, 0.05]
        flat.update(optim.flatten(stage_opt, names))
    # and back: every stage's entries to one device's numbering
    assert fmt.same_state(optim.to_native(flat, layout[0], 0), native)


def test_localize_copies_out_of_the_file():
    model, opt, _ = _trained()
    native = opt.state_dict()
    local = optim.localize(native, _layout(model, opt)[0], _layout(model, opt)[0], 0)
    assert local["state"][0]["exp_avg"].data_ptr() != native["state"][0]["exp_avg"].data_ptr()


def test_localize_refuses_mismatched_groups():
    model, opt, _ = _trained()
    native, (groups,) = opt.state_dict(), _layout(model, opt)
    with pytest.raises(PipelineCheckpointError, match=r"2 param group\(s\) of 3, 3 parameter\(s\), but .* builds 1"):
        optim.localize(native, [groups[0] + groups[1]], [groups[0] + groups[1]], 0)
    with pytest.raises(PipelineCheckpointError, match="with 1 param group.* on this rank's stages but 2 on the full"):
        optim.localize(native, groups, [groups[0]], 0)
    with pytest.raises(PipelineCheckpointError, match="puts '0.bias' in param group 0 .* but in group 1 on the full"):
        optim.localize(native, groups, [["0.weight", "0.bias"], []], 0)
    with pytest.raises(
        PipelineCheckpointError,
        match=r"puts 'x' in param group 0 of optimizer 0.*in no group.*full model.*by name or module",
    ):
        optim.localize(native, groups, [["x"], []], 0)
    fsdp = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["0.weight"]}]}
    with pytest.raises(PipelineCheckpointError, match="not in torch's native form"):
        optim.localize(fsdp, groups, groups, 0)


def test_to_native_refuses_missing_entries_and_empty_groups():
    model, opt, _ = _trained()
    (groups,) = _layout(model, opt)
    flat = optim.flatten(opt, optim.param_names(model))
    partial = {k: v for k, v in flat.items() if ".2." not in k}
    with pytest.raises(PipelineCheckpointError, match=r"no state for optimizer 3's parameters '2.bias', '2.weight'"):
        optim.to_native(partial, groups, 3)
    with pytest.raises(PipelineCheckpointError, match="Param group 1 of optimizer 0 holds no parameters"):
        optim.to_native(flat, [groups[0] + groups[1], []], 0)


def test_unflatten_keeps_own_hyperparameters_of_a_group_empty_on_this_rank():
    model, opt, _ = _trained()
    flat = optim.flatten(opt, optim.param_names(model))
    stage = nn.Sequential(nn.Linear(3, 4, bias=False))  # no biases: the second group is empty here
    stage[0].weight.data.copy_(model[0].weight)
    stage_opt = torch.optim.AdamW(_decay_groups(stage, lr=0.3), lr=0.3)
    native = optim.unflatten(stage_opt, optim.param_names(stage), flat)
    assert native["param_groups"][1]["params"] == [] and native["param_groups"][1]["lr"] == 0.15
    stage_opt.load_state_dict(native)
    assert stage_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


# ---------------------------------------------------------------------------------------------------- single process


def _lightning_file(path: Path, model: nn.Module, opt, sched) -> Path:
    """What a single-device Lightning checkpoint holds (the parts the conversion reads)."""
    torch.save(
        {
            "state_dict": model.state_dict(),
            "optimizer_states": [opt.state_dict()],
            "lr_schedulers": [sched.state_dict()],
            "global_step": 2,
        },
        path,
    )
    return path


def test_resume_from_file_per_rank_and_its_errors(tmp_path):
    model, opt, sched = _trained()
    path = _lightning_file(tmp_path / "single.ckpt", model, opt, sched)
    topo = io.Topology(0, 1, 0, 1, 0, 1, 1, "1F1B")
    layout = _layout(model, opt)
    for keep in ([0, 1], [2]):  # one rank at a time; strict=False: no other rank holds the other weights here
        torch.manual_seed(1)
        stage = _stage(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)), keep)
        stage_opt = torch.optim.AdamW(_decay_groups(stage), lr=0.1)
        rest = io.resume_from_file(path, topo, stage, [stage_opt], layout, strict=False)
        assert rest == {"lr_schedulers": [sched.state_dict()], "global_step": 2}
        full = dict(model.named_parameters())
        for name, p in stage.named_parameters():
            assert torch.equal(p, full[name])
            assert torch.equal(stage_opt.state[p]["exp_avg"], opt.state[full[name]]["exp_avg"])

    stage_opt = torch.optim.AdamW(_decay_groups(model), lr=0.1)
    regrouped = [[[name for group in layout[0] for name in group]]]
    for groups, pattern in [
        (None, r"parameter order of this LightningModule's optimizers was not recorded"),
        (regrouped, r"has 2 param group\(s\) of 3, 3 parameter\(s\), but"),
    ]:
        with pytest.raises(PipelineCheckpointError, match=rf"(?s)Cannot resume `fit` from .*{pattern}.*\(rank 0\)"):
            io.resume_from_file(path, topo, model, [stage_opt], groups, strict=True)
    with pytest.raises(PipelineCheckpointError, match=r"holds the state of 1 optimizer\(s\) but .* returned 2"):
        io.resume_from_file(path, topo, model, [stage_opt, stage_opt], layout * 2, strict=True)
    torch.save({"state_dict": model.state_dict(), "global_step": 2}, tmp_path / "weights.ckpt")
    with pytest.raises(PipelineCheckpointError, match=r"without optimizer state .*\(init_weights="):
        io.resume_from_file(tmp_path / "weights.ckpt", topo, model, [stage_opt], layout, strict=True)


def _directory(tmp_path: Path, model: nn.Module, opt, sched, param_groups=True, schedulers=None) -> Path:
    """A checkpoint directory as two pipeline ranks would write it, written from one process."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "pipe.ckpt"
    state = {"state_dict": model.state_dict(), "optimizer_0": optim.flatten(opt, optim.param_names(model))}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    torch.save({"global_step": 2, "epoch": 0}, path / fmt.TRAINER_STATE)
    for rank, states in enumerate(schedulers or [[sched.state_dict()]] * 2):
        (path / fmt.SCHEDULER_DIR).mkdir(exist_ok=True)
        torch.save(states, path / fmt.scheduler_file(rank))
    manifest = fmt.build_manifest(
        pipeline_size=2,
        data_parallel_size=1,
        stages_per_rank=1,
        schedule="1F1B",
        optimizers=1,
        lr_schedulers=True,
        module_class="m.M",
        param_groups=_layout(model, opt) if param_groups else None,
    )
    (path / fmt.MANIFEST).write_text(json.dumps(manifest))
    return path


def test_consolidate_with_optimizer_writes_torch_native_state(tmp_path, capsys):
    model, opt, sched = _trained()
    src = _directory(tmp_path, model, opt, sched)
    assert convert.inspect(src)[fmt.PARAM_GROUPS] == [[3, 3]]
    assert cli(["consolidate", "--with-optimizer", "--no-progress", str(src), str(tmp_path / "model.ckpt")]) == 0
    assert "wrote" in capsys.readouterr().err
    single = torch.load(tmp_path / "model.ckpt")
    assert fmt.same_state(single["optimizer_states"], [opt.state_dict()])
    assert single["lr_schedulers"] == [sched.state_dict()] and single["global_step"] == 2
    fresh = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    fresh.load_state_dict(single["state_dict"])
    fresh_opt = torch.optim.AdamW(_decay_groups(fresh), lr=0.1)
    fresh_opt.load_state_dict(single["optimizer_states"][0])  # what Lightning does on one device
    assert torch.equal(fresh_opt.state[fresh[2].bias]["exp_avg_sq"], opt.state[model[2].bias]["exp_avg_sq"])
    # without the flag: weights, loops, no optimizer or scheduler state (as before)
    convert.consolidate(src, tmp_path / "weights.ckpt")
    assert {"optimizer_states", "lr_schedulers"}.isdisjoint(torch.load(tmp_path / "weights.ckpt"))


def test_consolidate_with_optimizer_errors(tmp_path, capsys):
    model, opt, sched = _trained()
    other = copy.deepcopy(sched.state_dict())
    other["base_lrs"] = [1.0, 1.0]
    cases = {
        "order": (dict(param_groups=False), r"does not record its optimizers' parameter order on one device"),
        "schedulers": (
            dict(schedulers=[[sched.state_dict()], [other]]),
            r"LR scheduler states .* differ between pipeline ranks \(lr_schedulers/rank0.pt vs lr_schedulers/rank1",
        ),
    }
    for name, (kwargs, pattern) in cases.items():
        src = _directory(tmp_path / name, model, opt, sched, **kwargs)
        with pytest.raises(PipelineCheckpointError, match=pattern):
            convert.consolidate(src, tmp_path / "out.ckpt", with_optimizer=True)
    src = tmp_path / "order" / "pipe.ckpt"
    manifest = json.loads((src / fmt.MANIFEST).read_text())
    (src / fmt.MANIFEST).write_text(json.dumps({**manifest, "optimizers": 0}))
    assert cli(["consolidate", "--with-optimizer", str(src), str(tmp_path / "out.ckpt")]) == 1
    assert "holds no optimizer state (it was saved with weights only)" in capsys.readouterr().err
    assert not (tmp_path / "out.ckpt").exists()


# ---------------------------------------------------------------------------------------------------- multi-process


def _load(out: Path, name: str, ranks: int = 2) -> list[dict]:
    return [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(ranks)]


def _merged(parts: list[dict], key: str) -> dict:
    merged: dict = {}
    for part in parts:
        merged.update(part[key])
    return merged


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert fmt.same_state(a[k], b[k]), k


def _fit_one_device(max_epochs: int, ckpt_path: Path | None = None) -> tuple[L.Trainer, LitLMScheduled, Snapshot]:
    L.seed_everything(0)
    model = LitLMScheduled()
    snap = Snapshot()
    t = trainer("auto", devices=1, max_steps=-1, max_epochs=max_epochs, callbacks=[snap])
    t.fit(model, ckpt_path=ckpt_path)
    return t, model, snap


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """One device: the uninterrupted run and its first epoch saved (.ckpt); then ckpt_convert.py on 2 ranks."""
    out = tmp_path_factory.mktemp("convert")
    _, model, _ = _fit_one_device(max_epochs=3)
    torch.save({"losses": model.step_losses}, out / "single-straight.pt")
    t, model, _ = _fit_one_device(max_epochs=1)
    t.save_checkpoint(out / "single.ckpt")
    t.save_checkpoint(out / "single-weights.ckpt", weights_only=True)
    torch.save(snapshot(t, model), out / "single-saved.pt")
    run_script("ckpt_convert.py", str(out), nprocs=2, launcher="torchrun")
    return out


def _assert_resumed_one_device_run(out: Path, name: str, ranks: int = 2) -> None:
    straight = torch.load(out / "single-straight.pt")["losses"]
    saved = torch.load(out / "single-saved.pt", weights_only=False)
    assert len(straight) == 9
    resumed = _load(out, name, ranks)
    assert resumed[0]["global_step"] == 3, name
    # Restored state is a copy: weights, Adam moments and steps, param-group hyperparameters exactly equal.
    _assert_same(_merged(resumed, "state"), saved["state"])
    _assert_same(_merged(resumed, "optim"), saved["optim"])
    assert all(fmt.same_state(r["schedulers"], saved["schedulers"]) for r in resumed)
    # Later steps: the pipeline reduces microbatch losses and gradients in another order than one device.
    assert resumed[0]["losses"] == pytest.approx(straight[3:], abs=1e-6), name
    assert all(r["losses"] == resumed[0]["losses"] for r in resumed)


@pytest.mark.extended
@pytest.mark.slow
def test_one_device_to_pipeline_resumes_exactly(converted):
    for name in ("from-single-1f1b", "from-single-interleaved"):
        _assert_resumed_one_device_run(converted, name)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("name", ["pipe", "pipe4"])
def test_pipeline_to_one_device_resumes_exactly(converted, four_ranks, tmp_path, name):
    out = converted
    straight = torch.load(out / "single-straight.pt")["losses"]
    pipe = _load(out, f"{name}-saved", ranks=4 if name == "pipe4" else 2)
    dst = tmp_path / "model.ckpt"
    assert cli(["consolidate", "--with-optimizer", "--no-progress", str(out / f"{name}.ckpt"), str(dst)]) == 0

    # The file has a single-device run's layout: same param groups and numbering as Lightning's own .ckpt.
    single_file, own_file = torch.load(dst), torch.load(out / "single.ckpt")
    assert single_file.keys() == own_file.keys()
    assert [g["params"] for g in single_file["optimizer_states"][0]["param_groups"]] == [
        g["params"] for g in own_file["optimizer_states"][0]["param_groups"]
    ]
    # Adam moments of two runs of the same 3 steps (pipeline vs one device): equal up to reduction order.
    for index, state in own_file["optimizer_states"][0]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(single_file["optimizer_states"][0]["state"][index][key], value)

    t, model, snap = _fit_one_device(max_epochs=3, ckpt_path=dst)
    restored = snap.taken
    assert restored is not None and restored["global_step"] == 3
    _assert_same(restored["state"], _merged(pipe, "state"))
    _assert_same(restored["optim"], _merged(pipe, "optim"))
    assert fmt.same_state(restored["schedulers"], pipe[0]["schedulers"])
    assert model.step_losses == pytest.approx(straight[3:], abs=1e-6)


@pytest.fixture(scope="module")
def four_ranks(converted) -> Path:
    """ckpt_convert.py on 4 ranks: the single-device run resumed on a pipeline of 4 stages, and a checkpoint of it."""
    run_script("ckpt_convert.py", str(converted), "four", nprocs=4, launcher="torchrun")
    return converted


@pytest.mark.extended
@pytest.mark.slow
def test_one_device_to_four_stage_pipeline(four_ranks):
    _assert_resumed_one_device_run(four_ranks, "from-single-4ranks", ranks=4)


@pytest.mark.extended
@pytest.mark.slow
def test_single_file_resume_errors(converted):
    out = converted
    errors = agreed_errors(out)
    expected = {
        "weights-only": r"Cannot resume `fit` from .*single-weights\.ckpt.*without optimizer state.*init_weights=",
        "regrouped": r"Optimizer 0 in the checkpoint has 1 param group\(s\) of 53 parameter\(s\), but .* builds 2",
        "split-before-fit": r"parameter order .* was not recorded.*split by an earlier `validate`, `test` or `predict`",
    }
    assert errors.keys() == expected.keys()
    for name, pattern in expected.items():
        with pytest.raises(PipelineCheckpointError, match="(?s)" + pattern):
            raise PipelineCheckpointError(errors[name])


def test_consolidate_drops_the_stand_in_loaders_states():
    """The strategy's resumable stand-in loaders write a marker state that plain Lightning's loaders cannot take
    (Lightning refuses a resume whose count of loader states differs); a loader's own state stays."""
    from lightning_pipe.reliability.loaders import LOADER_STATE

    own = {"sampler_iter_yielded": 3}
    checkpoint = {"loops": {"fit_loop": {"state_dict": {"combined_loader": [dict(LOADER_STATE), own]}}}}
    convert._drop_stand_in_loader_states(checkpoint)
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [own]
    empty: dict = {}
    convert._drop_stand_in_loader_states(empty)  # a checkpoint without loops (saved outside fit) is left alone
    assert empty == {}
