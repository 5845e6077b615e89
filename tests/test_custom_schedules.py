"""Schedules of one's own (docs/custom-schedules.md): per-rank actions read, checked before any step, exported from
the built-in schedules, and run exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_pipe.errors import MicrobatchError, PipelineConfigError
from lightning_pipe.measure.simulate import schedule_orders
from lightning_pipe.schedules import builtin_schedule, export_schedule, load_schedule
from lightning_pipe.schedules.__main__ import main as schedules_cli
from lightning_pipe.schedules.names import SCHEDULES
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.step.executors.schedule import microbatch_plan
from tests.launch import SHARED_FOUR, agreed_errors, run_scenarios, run_script
from tests.reference import assert_data_parallel_parity, assert_parity, load_ranks, single_device_run

#: the 1F1B of 2 stages and 4 microbatches, by hand: stage 0 warms up with two forwards, stage 1 with one
ONE_F_ONE_B = [
    ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],
    ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"],
]
#: rank 0 waits for stage 1's backward of microbatch 0, rank 1 for stage 0's forward of microbatch 1
DEADLOCK = [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1F0", "1B0", "1B1"]]
MALFORMED = [["0F0", "0X1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]


def write(path: Path, rows: list[list[str]]) -> str:
    path.write_text("".join(",".join(row) + "\n" for row in rows))
    return str(path)


def edited_interleaved(path: Path) -> str:
    """Interleaved1F1B on 2 ranks x 2 stages, exported, with another warm-up: rank 0 runs all four forwards of stage
    0 before stage 2's first."""
    rows = export_schedule("Interleaved1F1B", 2, 4, path).texts()
    first = [a for a in rows[0] if a.startswith("0F")]
    rows[0] = first + [a for a in rows[0] if a not in first]
    return write(path, rows)


# ------------------------------------------------------------------------------------------------ reading
def test_a_hand_written_1f1b_reads_as_torch_1f1b(tmp_path):
    made = load_schedule(write(tmp_path / "1f1b.csv", ONE_F_ONE_B))
    assert (made.pipeline_size, made.num_stages, made.stages_per_rank, made.microbatches) == (2, 2, 1, 4)
    assert made.placement == "loop"
    assert made.actions == schedule_orders("1F1B", 2, 4, 1)


def test_lists_and_overlapped_cells():
    rows = [["0F0", "(0F1;3B0)OVERLAP_F_B"], ["1F0", "2F0 ; 1B0"]]
    with pytest.raises(PipelineConfigError):  # stages 2 and 3 run once only: still parsed, then refused
        load_schedule(rows)
    made = builtin_schedule("DualPipeV", 2, 4, 2)
    assert load_schedule(made.texts()).rows == made.rows
    assert made.placement == "v"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_builtin_schedule_exports_and_reads_back(tmp_path, schedule):
    spr = 1 if schedule in ("GPipe", "1F1B") else 2
    written = export_schedule(schedule, 2, 4, tmp_path / "s.csv", spr)
    read = load_schedule(tmp_path / "s.csv")
    assert read.rows == written.rows
    assert read.actions == schedule_orders(schedule, 2, 4, spr)


def test_the_timeline_explains_a_bubble_from_the_given_actions():
    from lightning_pipe.measure.simulate import explain_bubble

    durations = {(s, k): t for s in range(2) for k, t in (("F", 1.0), ("B", 2.0), ("L", 0.1))}
    given = [[tuple(a) for a in rank] for rank in load_schedule(ONE_F_ONE_B).actions]
    assert explain_bubble(durations, 0.3, given, 2, 4, 1, [0, 1]) == explain_bubble(
        durations, 0.3, "1F1B", 2, 4, 1, [0, 1]
    )


def test_the_cli_exports_and_checks(tmp_path, capsys):
    out = tmp_path / "i.csv"
    assert schedules_cli(["export", "--schedule", "1f1b", "--pipeline-size", "2", "--microbatches", "4", str(out)]) == 0
    assert load_schedule(out).actions == schedule_orders("1F1B", 2, 4, 1)
    assert schedules_cli(["check", write(tmp_path / "d.csv", DEADLOCK)]) == 1
    assert "deadlocks" in capsys.readouterr().err


def test_lightning_cli_passes_a_path(tmp_path):
    from jsonargparse import ArgumentParser

    from lightning_pipe import PipelineParallelStrategy

    parser = ArgumentParser()
    parser.add_class_arguments(PipelineParallelStrategy, "strategy")
    path = write(tmp_path / "1f1b.csv", ONE_F_ONE_B)
    assert parser.parse_args(["--strategy.schedule", path]).strategy.schedule == path
    made = parser.instantiate(parser.parse_args(["--strategy.schedule", path])).strategy
    assert made.schedule_name == f"custom schedule {path}"
    assert parser.parse_args(["--strategy.schedule", "gpipe"]).strategy.schedule == "gpipe"


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    ("rows", "rank", "action", "reason"),
    [
        (MALFORMED, 0, "0X1", "not an action"),
        ([["0F0", "0SEND_F0"], ["1F0"]], 0, "0SEND_F0", "communication action"),
        ([["0F0", "(0F1)OVERLAP_F_B"], ["1F0"]], 0, "(0F1)OVERLAP_F_B", "exactly two actions"),
        (DEADLOCK, 0, "0B0", "deadlocks: rank 0 waits at 0B0 for 1B0; rank 1 waits at 1F1 for 0F1"),
        ([["0F0", "0B0", "0B0"], ["1F0", "1B0"]], 0, "0B0", "runs twice"),
        ([["0B0", "0F0"], ["1F0", "1B0"]], 0, "0B0", "runs before 0F0 on this rank"),
        ([["0F0", "0I0", "0B0"], ["1F0", "1B0"]], 0, "0B0", "either B or I then W"),
        ([["0F0", "0F1", "0B0"], ["1F0", "1B0", "1F1", "1B1"]], 0, "", "stage 0 never runs the backward of"),
        ([["0F0", "0B0", "1F0", "1B0"], ["2F0", "2B0"]], 0, "", "3 stages do not divide among 2 ranks"),
        ([["0F0", "0B0"], ["0F1", "0B1"]], 1, "0F1", "already runs on rank 0"),
        ([["0F0", "1F0", "1B0", "0B0"], ["2F0", "3F0", "3B0", "2B0"]], 0, "1F0", "neither round robin"),
        ([["0F0", "0B0"], []], 1, "", "needs a row of actions"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_refusals_name_the_rank_the_action_and_the_reason(rows, rank, action, reason):
    with pytest.raises(PipelineConfigError) as err:
        load_schedule(rows)
    text = str(err.value)
    assert f"rank {rank}" in text and reason in text
    if action:
        assert f"action {action!r}" in text


def test_lists_of_another_shape_and_counts_torch_refuses(tmp_path):
    with pytest.raises(PipelineConfigError, match=r"list of action strings.*got"):
        PipelineSettings(schedule=[0, 1])
    with pytest.raises(PipelineConfigError, match=r"list of action strings.*got"):
        PipelineSettings(schedule=[[0, 1]])
    with pytest.raises(PipelineConfigError, match="torch's 1F1B schedule does not run 2 microbatches on 4 ranks"):
        export_schedule("1F1B", 4, 2, tmp_path / "s.csv")


def test_the_tuner_keeps_a_custom_schedule_runs_its_trials_and_names_its_csv(tmp_path):
    import yaml

    from lightning_pipe import PipelineParallelStrategy, SearchSpace, tune
    from tests.models import LitLM, quiet_trainer

    path = write(tmp_path / "one_rank.csv", [["0F0", "0F1", "0B0", "0B1"]])
    strategy = PipelineParallelStrategy(schedule=path)
    trainer = quiet_trainer(devices=1, strategy=strategy, default_root_dir=str(tmp_path))
    # the space's schedules and microbatches give way to the strategy's schedule; checkpointing varies
    space = SearchSpace(schedules=("GPipe",), microbatches=(1,), activation_checkpointing=(0, 1))
    # margin=10: both candidates are measured, however far apart predicted
    result = tune(trainer, LitLM(), space=space, steps=1, warmup_steps=1, max_trials=2, margin=10.0, confirm=0)
    assert {(r.candidate.schedule, r.candidate.microbatches) for r in result.rows} == {(strategy.settings.schedule, 2)}
    assert sorted(r.candidate.activation_checkpointing for r in result.rows if r.measured) == [0, 1]  # both ran
    # How sure the choice is, against the other candidate (`confirm=0`: nothing measured again)
    rival = next(r.candidate.label for r in result.rows if r.measured and r.candidate != result.choice)
    assert result.sureness["rival"] == rival and 0 <= result.sureness["probability"] <= 1
    assert result.cost["repeated"] == 0 and json.loads(result.files[0].read_text())["sureness"] == result.sureness
    assert result.settings["schedule"] == path and "one_rank.csv M=2 v=1" in result.table
    init_args = yaml.safe_load(result.files[1].read_text())["trainer"]["strategy"]["init_args"]
    assert init_args["schedule"] == path and init_args["microbatches"] == 2
    assert trainer.strategy.settings.schedule == load_schedule(path)


def test_a_csv_refused_names_the_file(tmp_path):
    path = write(tmp_path / "bad.csv", MALFORMED)
    with pytest.raises(PipelineConfigError, match="bad.csv.*rank 0, action '0X1'"):
        PipelineSettings(schedule=path)
    with pytest.raises(PipelineConfigError, match=r"missing\.csv.*neither a schedule name"):
        PipelineSettings(schedule=str(tmp_path / "missing.csv"))
    with pytest.raises(PipelineConfigError, match="Unknown `schedule='1f2b'`"):
        PipelineSettings(schedule="1f2b")


# ------------------------------------------------------------------------------------------------ the settings
def test_the_schedule_decides_the_counts(tmp_path):
    s = PipelineSettings(schedule=ONE_F_ONE_B).resolve(world_size=4)
    assert (s.pipeline_size, s.stages_per_rank, s.microbatches, s.data_parallel_size) == (2, 1, 4, 2)
    assert s.placement == "loop" and str(s.schedule) == "custom schedule the given lists"
    interleaved = PipelineSettings(schedule=edited_interleaved(tmp_path / "i.csv")).resolve(world_size=2)
    assert (interleaved.num_stages, interleaved.stages_per_rank) == (4, 2)
    assert PipelineSettings(schedule=builtin_schedule("ZBVZeroBubble", 2, 4, 2).texts()).resolve(2).placement == "v"


@pytest.mark.parametrize(
    ("argument", "value", "names"),
    [
        ("pipeline_size", 4, ["2 rank(s)", "`pipeline_size=4`"]),
        ("microbatches", 8, ["4 microbatch(es)", "`microbatches=8`"]),
        ("stages_per_rank", 2, ["1 per rank", "`stages_per_rank=2`"]),
        ("microbatch_size", 2, ["4 microbatch(es)", "`microbatch_size` cannot be set"]),
    ],
)
def test_arguments_that_disagree_with_the_schedule_are_refused(argument, value, names):
    with pytest.raises(PipelineConfigError) as err:
        PipelineSettings(schedule=ONE_F_ONE_B, **{argument: value})
    assert all(n in str(err.value) for n in names)


def test_compile_is_refused_with_split_backwards():
    zero_bubble = builtin_schedule("InterleavedZeroBubble", 2, 4, 2).texts()
    with pytest.raises(PipelineConfigError, match="`compile` cannot be used"):
        PipelineSettings(schedule=zero_bubble, compile=True)
    PipelineSettings(schedule=ONE_F_ONE_B, compile=True)


def test_a_batch_the_microbatches_do_not_divide_is_refused():
    s = PipelineSettings(schedule=ONE_F_ONE_B).resolve(world_size=2)
    assert microbatch_plan(s, 8) == (4, s.schedule)
    with pytest.raises(MicrobatchError, match=r"6 samples.*4 equal microbatches"):
        microbatch_plan(s, 6)


# ------------------------------------------------------------------------------------------------ two processes
@pytest.mark.slow
def test_custom_schedules_train_exactly_and_bad_ones_are_refused_on_every_rank(tmp_path):
    one_f_one_b = write(tmp_path / "1f1b.csv", ONE_F_ONE_B)
    configs = [
        {"name": "deadlock", "schedule": write(tmp_path / "deadlock.csv", DEADLOCK), "refused": True},
        {"name": "malformed", "schedule": write(tmp_path / "malformed.csv", MALFORMED), "refused": True},
        {"name": "named", "schedule": "1F1B", "microbatches": 4},
        {"name": "csv", "schedule": one_f_one_b, "save": str(tmp_path / "saved")},
        {"name": "interleaved", "schedule": edited_interleaved(tmp_path / "interleaved.csv")},
        # the checkpoint saved under the hand-written 1F1B (2 stages), resumed under the edited interleaved (4 stages)
        {
            "name": "resumed",
            "schedule": str(tmp_path / "interleaved.csv"),
            "ckpt_path": str(tmp_path / "saved" / "last.ckpt"),
            "max_epochs": 2,
        },
    ]
    run_script("custom_schedule.py", str(tmp_path), json.dumps(configs), nprocs=2, timeout=240)
    errors = agreed_errors(tmp_path)
    assert "rank 0, action '0B0': the schedule deadlocks" in errors["deadlock"]
    assert "rank 0, action '0X1': not an action" in errors["malformed"]
    named, csv = load_ranks(tmp_path, "named"), load_ranks(tmp_path, "csv")
    # the hand-written 1F1B runs torch's 1F1B op for op: bitwise the same losses and weights
    for a, b in zip(named, csv):
        assert a["losses"] == b["losses"]
        assert a["state"].keys() == b["state"].keys()
        assert all(a["state"][k].equal(b["state"][k]) for k in a["state"])
    assert csv[0]["schedule"] == f"custom schedule {one_f_one_b}"
    interleaved = load_ranks(tmp_path, "interleaved")
    assert [r["stages_per_rank"] for r in interleaved] == [2, 2]
    assert_parity(interleaved, *single_device_run(accumulate=2, clip=0.05, max_steps=4), rtol=0, atol=1e-5)
    # the second epoch, resumed from the first's checkpoint, continues as one device's 8 steps
    ref_losses, ref_state = single_device_run(accumulate=2, clip=0.05, max_steps=8)
    assert_parity(load_ranks(tmp_path, "resumed"), ref_losses[8:], ref_state, rtol=0, atol=1e-5)
    # validation runs the forward-only pass of every schedule: the same loss on every rank, as under 1F1B
    val = named[0]["val_loss"]
    assert {r["val_loss"] for r in named + csv} == {val}
    assert all(abs(r["val_loss"] - val) < 1e-5 for r in interleaved)


@pytest.mark.extended
@pytest.mark.slow
def test_a_custom_schedule_under_data_parallelism(tmp_path):
    """2 replicas (DDP) of the hand-written 1F1B on 2 stages, 4 processes: as one device on the global batch."""
    schedule = write(tmp_path / "1f1b.csv", ONE_F_ONE_B)
    config = {"name": "dp2-pp2", "schedule": schedule, "devices": 4, "pipeline_size": 2, "accumulate": 2, "clip": 0.05}
    launch = run_scenarios("parity.py", tmp_path, [config], nprocs=4, launcher="torchrun", timeout=240)
    assert_data_parallel_parity(launch.ranks("dp2-pp2"), accumulate=2, clip=0.05)


@pytest.mark.extended
@pytest.mark.slow
def test_a_custom_schedule_under_fsdp_in_fabric(tmp_path):
    """2 FSDP replicas of the hand-written 1F1B on 2 stages under Fabric, 4 processes: the losses and the clip's
    global norms of one device on the global batch (FSDP's weights are shards)."""
    from lightning.fabric import Fabric

    from tests.fabric_loop import train

    schedule = write(tmp_path / "1f1b.csv", ONE_F_ONE_B)
    loop = {"accumulate": 2, "clip": 0.05, "batch": 16}
    config = {"name": "fsdp", "schedule": schedule, "devices": 4, "pipeline_size": 2, "data_parallel": "fsdp"}
    run_script("fabric_parity.py", str(tmp_path), json.dumps([config | loop | {"replicas": 2}]), nprocs=4, timeout=240)
    one_device = Fabric(accelerator="cpu", devices=1)
    losses, _, norms = train(one_device, loop | {"n_layer": 4, "lora": False}, pipelined=False)
    assert max(norms) > 0.05, "the clip is active in the reference"
    for r in range(4):
        ran = torch.load(tmp_path / f"fsdp.rank{r}.pt")
        torch.testing.assert_close(torch.tensor(ran["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(torch.tensor(ran["norms"]), torch.tensor(norms), rtol=1e-5, atol=1e-7)


def _export_1f1b(out: Path) -> None:
    export_schedule("1F1B", 2, 2, str(out / "1f1b.csv"))


def _tensor_parallel_configs(out: Path) -> list[dict]:
    from lightning_pipe.compat import torch as torch_compat
    from tests import test_tensor_parallel as tp

    if not torch_compat.stage_takes_mesh():
        return []  # the fixture skips
    return [{**tp.TP2, "name": "csv", "clip": tp.CLIP, "val": 2, "schedule": str(out / "1f1b.csv")}]


SHARED_FOUR.part(
    __name__, "tensor_parallel", "tensor_parallel.py", _tensor_parallel_configs, timeout=400, prepare=_export_1f1b
)


@pytest.fixture(scope="module")
def tensor_parallel(request):
    from tests import test_tensor_parallel as tp

    tp._needs_dtensor_stages()
    return SHARED_FOUR.launch(request)  # the 4-process launch shared with other modules (tests/launch.py Shared)


@pytest.mark.extended
@pytest.mark.slow
def test_a_custom_schedule_under_tensor_parallelism(tensor_parallel):
    """The exported 1F1B of 2 stages x 2 microbatches, each stage over 2 tensor-parallel processes (4 in all), with
    validation: as one device."""
    from tests import test_tensor_parallel as tp

    tp._assert_parity(tensor_parallel.ranks("csv"), tp.decoder_reference())
