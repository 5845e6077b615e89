"""Data parallel x pipeline (``data_parallel="ddp"|"fsdp"``), mesh layouts over nodes, activation checkpointing.

Pure logic first (buckets, layouts, settings, errors); then four multi-process launches (tests/scripts/data_parallel.py)
whose outputs many tests read: 2 processes (activation checkpointing under all 7 schedules; a ``ddp`` 2 x 1
checkpoint), 4 processes (2 x 2 ``ddp``/``fsdp`` parity, collectives per optimizer step, optimizer-state bytes,
schedules, bf16, evaluation, checkpoints across modes), 2 processes (the ``fsdp`` checkpoint resumed as ``ddp`` 2 x 1),
and 2 simulated nodes of 2 processes with each mesh layout. Each scenario leaves its own outcome (its result or its
traceback), and each has a test of its own: a failing scenario fails its tests, not the launch's other scenarios'.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest
import torch
from torch import nn

from lightning_pipe import PipelineConfigError, PipelineParallelStrategy
from lightning_pipe.comm.mesh import MeshLayout
from lightning_pipe.parallel.data_parallel import check_token_weighting
from lightning_pipe.parallel.grads import GradientSync, clip_grad_norm_across, plan_buckets
from lightning_pipe.parallel.wrappers import unwrap_stages, wrap_stages
from lightning_pipe.settings import PipelineSettings, check_data_parallel, check_inner_axis
from tests.launch import ROOT, SCRIPTS, Launch, clean_env, free_port, run_scenarios
from tests.models import TinyLM
from tests.reference import (
    assert_parity,
    merged_state,
    single_device_data_parallel_run,
    single_device_run,
)

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
CLIP = 0.05
BUCKET = 4096  # bytes: a stage of LitLM (4 blocks of ~4.4 KiB) then needs several buckets


# ---------------------------------------------------------------------------------------------------- pure logic
def test_buckets_hold_consecutive_tensors_of_one_dtype_up_to_the_cap():
    f32, bf16 = torch.float32, torch.bfloat16
    sizes = [(40, f32), (40, f32), (30, f32), (200, f32), (10, bf16), (10, f32), (10, bf16)]
    assert plan_buckets(sizes, 100) == [[0, 1], [2], [3], [4, 6], [5]]
    assert plan_buckets([], 100) == []
    assert plan_buckets([(8, f32)] * 4, 10**9) == [[0, 1, 2, 3]]


def test_gradient_sync_without_replicas_only_counts():
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    sync = GradientSync(None, average=True)
    sync.synchronize([p])
    assert sync.count == 1 and sync.last_buckets == 0
    assert torch.equal(p.grad, torch.full((3,), 2.0))


def test_clip_without_group_equals_torch():
    torch.manual_seed(0)
    a = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))]
    b = [nn.Parameter(t.detach().clone()) for t in a]
    for x, y in zip(a, b):
        x.grad = torch.randn_like(x)
        y.grad = x.grad.clone()
    ours = clip_grad_norm_across(a, 0.5, None)
    theirs = torch.nn.utils.clip_grad_norm_(b, 0.5)
    torch.testing.assert_close(ours, theirs)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad)


def test_default_layout_keeps_replicas_of_a_stage_on_consecutive_ranks():
    layout = MeshLayout(pipeline_size=2, data_parallel_size=3)
    assert layout.inner == "dp" and layout.axis_names == ("pp", "dp", "tp")
    assert layout.replica_ranks(0) == [0, 1, 2] and layout.pipeline_ranks(0) == [0, 3]
    assert [layout.coordinates(r) for r in range(6)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    pipelines_inner = MeshLayout(2, 3, inner="pp")
    assert pipelines_inner.pipeline_ranks(1) == [2, 3] and pipelines_inner.replica_ranks(0) == [0, 2, 4]


def settings(mode: str, replicas: int) -> PipelineSettings:
    """Resolved settings of one-process pipelines with ``replicas`` data-parallel replicas."""
    return PipelineSettings(pipeline_size=1, data_parallel=mode).resolve(replicas)


def test_settings_are_checked_in_the_constructor():
    with pytest.raises(PipelineConfigError, match=r"`data_parallel='zero'` is not one of 'ddp', 'fsdp'"):
        PipelineParallelStrategy(data_parallel="zero")  # type: ignore[arg-type]
    with pytest.raises(PipelineConfigError, match=r"`inner_axis='tp'` is not one of 'dp', 'pp'"):
        PipelineParallelStrategy(inner_axis="tp")  # type: ignore[arg-type]
    with pytest.raises(PipelineConfigError, match=r"`activation_checkpointing=-1`.*bool or an int >= 0.*Use True"):
        PipelineParallelStrategy(activation_checkpointing=-1)
    with pytest.raises(PipelineConfigError, match="is not one of 'dp', 'pp'"):
        check_inner_axis("node")
    check_data_parallel("fsdp")
    assert settings("fsdp", 2).sharded and not settings("fsdp", 1).sharded and not settings("ddp", 4).sharded


def test_fsdp_refuses_token_weighted_accumulation():
    acc2, fabric = "`accumulate_grad_batches=2`", "`fabric.no_backward_sync`"
    for window in (acc2, fabric):
        with pytest.raises(PipelineConfigError, match=rf"`data_parallel='fsdp'` with {window} cannot weight .* Use"):
            check_token_weighting(settings("fsdp", 2), 0.01, window=window)
    check_token_weighting(settings("ddp", 2), 0.01, window=acc2)  # ddp scales each batch before the window's sum
    check_token_weighting(settings("fsdp", 2), 0.01)  # one batch per step: one scale (equal counts: multi-process test)
    check_token_weighting(settings("fsdp", 1), 0.01, window=acc2)  # one replica: nothing is sharded
    check_token_weighting(settings("fsdp", 2), None, window=acc2)


class _Stage(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body


def test_wrappers_checkpoint_every_kth_block_of_the_whole_stack_without_fsdp():
    network = TinyLM(n_layers=6)
    blocks = [f"layers.{i}" for i in range(6)]
    first, second = _Stage(nn.Module()), _Stage(nn.Module())
    first.body.layers = nn.ModuleDict({str(i): network.layers[i] for i in range(3)})
    second.body.layers = nn.ModuleDict({str(i): network.layers[i] for i in range(3, 6)})
    done = wrap_stages({0: first, 1: second}, blocks, checkpoint_every=2, dp_mesh=None, sharded_over=None)
    assert done.checkpointed == ["layers.1", "layers.3", "layers.5"]  # counted over the stack, not per stage
    assert not done.sharded and done.sharded_blocks == []
    assert "forward" in vars(network.layers[1]) and "forward" not in vars(network.layers[0])
    unwrap_stages({0: first, 1: second})  # at the Trainer entry's end: the blocks' own forward again
    assert not any("forward" in vars(block) for block in network.layers)
    with pytest.raises(
        PipelineConfigError,
        match=r"earlier Trainer sharded.*stages with FSDP.*ranks \[0, 1\].*`data_parallel='fsdp'`.*new LightningModule",
    ):
        wrap_stages({0: first}, blocks, checkpoint_every=0, dp_mesh=None, sharded_over=(0, 1))


# ---------------------------------------------------------------------------------------------------- launches
def _configs_two() -> list[dict]:
    configs = [
        {"name": f"ac-{s}", "devices": 2, "schedule": s, "activation_checkpointing": True if i % 2 == 0 else 2}
        for i, s in enumerate(SCHEDULES)
    ]
    # One-stage pipelines, two replicas: plain data parallelism through the strategy.
    one = {"devices": 2, "pipeline_size": 1, "accumulate": 2, "clip": CLIP}
    configs.append({**one, "name": "pp1-ddp", "data_parallel": "ddp", "save": "pp1.ckpt"})
    configs.append({**one, "name": "pp1-fsdp", "data_parallel": "fsdp"})
    return configs


#: The 4-process scenario whose result is the error every rank raised.
REFUSED = "fsdp-weighted-acc2"


def _configs_four() -> list[dict]:
    dp = {"devices": 4, "pipeline_size": 2}
    return [
        {**dp, "name": "ddp-acc2", "data_parallel": "ddp", "accumulate": 2, "clip": CLIP, "bucket_bytes": BUCKET},
        {**dp, "name": "fsdp-acc2", "data_parallel": "fsdp", "accumulate": 2, "clip": CLIP},
        # manual optimization: what ddp-acc2 does, written in the module's training_step
        {**dp, "name": "ddp-manual", "model": "manual", "accumulate": 2, "clip": CLIP, "bucket_bytes": BUCKET},
        {**dp, "name": "ddp-acc3", "data_parallel": "ddp", "accumulate": 3, "bucket_bytes": BUCKET, "max_steps": 3},
        {**dp, "name": "fsdp-acc1", "data_parallel": "fsdp", "max_steps": 3},
        {**dp, "name": "fsdp-acc3", "data_parallel": "fsdp", "accumulate": 3, "max_steps": 3},
        {
            **dp,
            "name": "fsdp-interleaved-ac",
            "data_parallel": "fsdp",
            "schedule": "Interleaved1F1B",
            "activation_checkpointing": True,
            "accumulate": 2,
            "clip": CLIP,
        },
        {**dp, "name": "fsdp-zbv", "data_parallel": "fsdp", "schedule": "ZBVZeroBubble", "accumulate": 2, "clip": CLIP},
        {**dp, "name": "ddp-bf16", "data_parallel": "ddp", "precision": "bf16-mixed", "max_steps": 3},
        {**dp, "name": "fsdp-bf16", "data_parallel": "fsdp", "precision": "bf16-mixed", "max_steps": 3},
        {**dp, "name": "ddp-bf16-true", "data_parallel": "ddp", "precision": "bf16-true", "max_steps": 3},
        {**dp, "name": "fsdp-bf16-true", "data_parallel": "fsdp", "precision": "bf16-true", "max_steps": 3},
        {**dp, "name": "ddp-eval", "model": "eval", "data_parallel": "ddp", "max_steps": 2, "validate": True},
        {**dp, "name": "fsdp-eval", "model": "eval", "data_parallel": "fsdp", "max_steps": 2, "validate": True},
        {**dp, "name": "fsdp-save", "model": "scheduled", "data_parallel": "fsdp", "max_steps": 3, "save": "fsdp.ckpt"},
        {
            **dp,
            "name": "fsdp-from-ddp",
            "model": "scheduled",
            "data_parallel": "fsdp",
            "max_steps": 4,
            "resume": "ddp.ckpt",
        },
        # An expected error (every rank refuses the step) is this scenario's result; the group serves the next one.
        {**dp, "name": REFUSED, "model": "weighted", "data_parallel": "fsdp", "accumulate": 2},
        # 61 samples: each replica's shard is 31 (padded), its last batch 7, run as 7 microbatches of 1
        {**dp, "name": "ddp-odd-last-weighted", "model": "weighted", "samples": 61, "max_steps": 5, "clip": CLIP},
    ]


def _configs_nodes() -> list[dict]:
    node = {"devices": 2, "num_nodes": 2, "pipeline_size": 2, "accumulate": 2, "clip": CLIP}
    return [
        {**node, "name": f"nodes-{inner}-{mode}", "inner_axis": inner, "data_parallel": mode}
        for inner in ("dp", "pp")
        for mode in ("ddp", "fsdp")
    ]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("data_parallel")


def _configs_saved() -> list[dict]:
    """The checkpoint the 4-process launch resumes (fsdp-from-ddp): a launch of its own, so that the extended tier,
    which reads no other 2-process scenario, does not run the whole 2-process launch again."""
    return [
        {"name": "ddp-save", "devices": 2, "pipeline_size": 2, "model": "scheduled", "max_steps": 3, "save": "ddp.ckpt"}
    ]


def _configs_resumed() -> list[dict]:
    cfg = {"name": "ddp-from-fsdp", "devices": 2, "pipeline_size": 2, "model": "scheduled", "max_steps": 4}
    return [{**cfg, "resume": "fsdp.ckpt"}]


# The launches' results, collected once per module: each test reads its own scenario's (Launch.ranks).
@pytest.fixture(scope="module")
def two(out) -> Launch:
    return run_scenarios("data_parallel.py", out, _configs_two(), nprocs=2, launcher="lightning")


@pytest.fixture(scope="module")
def saved_two(out) -> Launch:
    return run_scenarios("data_parallel.py", out, _configs_saved(), nprocs=2, launcher="lightning")


@pytest.fixture(scope="module")
def four(saved_two) -> Launch:  # after `saved_two`: fsdp-from-ddp resumes its ddp.ckpt
    return run_scenarios("data_parallel.py", saved_two.out, _configs_four(), nprocs=4, launcher="torchrun")


@pytest.fixture(scope="module")
def resumed_two(four) -> Launch:  # after `four`: ddp-from-fsdp resumes its fsdp.ckpt
    return run_scenarios("data_parallel.py", four.out, _configs_resumed(), nprocs=2)


def run_nodes(args: list[str], num_nodes: int, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the script once per simulated node (``NODE_RANK``), all on this machine, as a multi-node job would; the
    nodes' exit status (the first non-zero one) and their outputs, one after the other."""
    port = str(free_port())
    procs = []
    with tempfile.TemporaryDirectory() as logs:
        for node in range(num_nodes):
            env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node))
            stdout = open(os.path.join(logs, f"{node}.out"), "w+")  # noqa: SIM115 (closed below)
            cmd = [sys.executable, str(SCRIPTS / "data_parallel.py"), *args]
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
            procs.append((proc, stdout))
        results = []
        for proc, stdout in procs:
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = -signal.SIGKILL
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            stdout.seek(0)
            results.append(subprocess.CompletedProcess(proc.args, code, stdout.read(), ""))
            stdout.close()
    code = next((result.returncode for result in results if result.returncode != 0), 0)
    output = "".join(f"--- node {node}\n{result.stdout[-6000:]}\n" for node, result in enumerate(results))
    return subprocess.CompletedProcess(results[0].args, code, output, "")


@pytest.fixture(scope="module")
def nodes(out) -> Launch:
    return Launch(out, 4, run_nodes([str(out), json.dumps(_configs_nodes())], num_nodes=2))


def _replica_mean(ranks: list[dict]) -> list[dict]:
    """Every rank with the mean of the replicas' per-step losses (the global batch's loss)."""
    per_replica = {r["dp_rank"]: r["losses"] for r in ranks}
    mean = [sum(step) / len(step) for step in zip(*per_replica.values())]
    return [{**r, "losses": mean} for r in ranks]


# ---------------------------------------------------------------------------------------------------- each scenario
def _each(launch: str, configs: list[dict], *marks: pytest.MarkDecorator) -> list:
    return [pytest.param(launch, cfg["name"], id=cfg["name"], marks=[*marks, pytest.mark.slow]) for cfg in configs]


@pytest.mark.parametrize(
    ("launch", "name"),
    _each("two", _configs_two())
    + _each("saved_two", _configs_saved(), pytest.mark.extended)
    + _each("four", _configs_four(), pytest.mark.extended)
    + _each("resumed_two", _configs_resumed(), pytest.mark.extended)
    + _each("nodes", _configs_nodes(), pytest.mark.extended),
)
def test_every_scenario_leaves_a_result_on_every_rank(request, launch, name):
    ranks = request.getfixturevalue(launch).ranks(name)  # fails with the scenario's own traceback
    errors = [r["error"] for r in ranks]
    assert all(errors) if name == REFUSED else errors == [None] * len(ranks), errors


# ---------------------------------------------------------------------------------------------------- parity
@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_activation_checkpointing_keeps_parity_under_every_schedule(two, schedule):
    ranks = two.ranks(f"ac-{schedule}")
    assert len(ranks) == 2
    assert all(r["checkpointed"] for r in ranks)  # blocks were checkpointed on every rank
    assert_parity(ranks, *single_device_run())


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp-acc2", "fsdp-acc2", "fsdp-interleaved-ac", "fsdp-zbv"])
def test_two_by_two_matches_one_device_on_the_global_batch(four, name):
    ranks = four.ranks(name)
    assert sorted((r["dp_rank"], r["pipeline_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert ranks[0]["losses"] != [r for r in ranks if r["dp_rank"] == 1][0]["losses"]  # replicas saw other data
    assert_parity(_replica_mean(ranks), *single_device_data_parallel_run(2, accumulate=2, clip=CLIP))


@pytest.mark.extended
@pytest.mark.slow
def test_manual_optimization_under_data_parallelism_trains_bitwise_as_automatic(four):
    # The module accumulates 2 batches (each loss halved), clips and steps itself; the replicas' gradients are averaged
    # once per step, before the clip reads them: the same numbers as accumulate_grad_batches=2, gradient_clip_val.
    manual, automatic = four.ranks("ddp-manual"), four.ranks("ddp-acc2")
    assert len(manual) == 4
    for got, want in zip(manual, automatic, strict=True):
        assert (got["dp_rank"], got["pipeline_rank"]) == (want["dp_rank"], want["pipeline_rank"])
        assert got["state"].keys() == want["state"].keys() and got["state"]
        assert all(torch.equal(v, want["state"][k]) for k, v in got["state"].items())
        # Lightning hands on_train_batch_end the loss divided by accumulate_grad_batches; a manual step's is whole
        assert got["losses"] == [2 * loss for loss in want["losses"]] and len(got["losses"]) == 12


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_one_stage_pipelines_are_plain_data_parallelism(two, mode):
    ranks = two.ranks(f"pp1-{mode}")
    assert sorted(r["dp_rank"] for r in ranks) == [0, 1] and {r["pipeline_rank"] for r in ranks} == {0}
    assert_parity(_replica_mean(ranks), *single_device_data_parallel_run(2, accumulate=2, clip=CLIP))
    if mode == "ddp":
        assert (two.out / "pp1.ckpt" / "lightning_pipe.json").is_file()  # the one-rank pipeline saved alone


# ---------------------------------------------------------------------------------------------------- collectives
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp-acc2", "ddp-acc3"])
def test_ddp_all_reduces_each_bucket_once_per_optimizer_step(four, name):
    for r in four.ranks(name):
        assert len(r["per_step"]) == 3 if name == "ddp-acc3" else 6
        assert r["buckets"][0] > 1  # several buckets, not one flat copy
        assert r["per_step"] == [{"all_reduce": n} for n in r["buckets"]], r["per_step"]


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp-acc1", "fsdp-acc2", "fsdp-acc3"])
def test_fsdp_reduce_scatters_each_unit_once_per_optimizer_step(four, name):
    for r in four.ranks(name):
        assert r["units"] == 5  # 4 blocks and the stage's root (embedding, or norm and head)
        # FSDP2 calls `reduce_scatter_single` from torch 2.13 on, `reduce_scatter_tensor` before.
        scatters = [
            step.get("reduce_scatter_single", 0) + step.get("reduce_scatter_tensor", 0) for step in r["per_step"]
        ]
        assert scatters == [r["units"]] * len(r["per_step"])
        assert all("all_reduce" not in step for step in r["per_step"])


@pytest.mark.extended
@pytest.mark.slow
def test_fsdp_holds_half_the_optimizer_state_of_ddp_per_rank(saved_two, four):
    ddp = {r["pipeline_rank"]: r["optimizer_bytes"] for r in saved_two.ranks("ddp-save")}
    for r in four.ranks("fsdp-save"):
        ratio = r["optimizer_bytes"] / ddp[r["pipeline_rank"]]
        assert abs(ratio - 0.5) <= 0.05, ratio  # 1/dp within 10%


# ---------------------------------------------------------------------------------------------- precision, evaluation
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "bf16-true"])
def test_bf16_fsdp_trains_as_ddp(four, precision):
    ddp, fsdp = (four.ranks(f"{mode}-{precision}") for mode in ("ddp", "fsdp"))
    for a, b in zip(sorted(ddp, key=lambda r: r["global_rank"]), sorted(fsdp, key=lambda r: r["global_rank"])):
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=1e-3, atol=1e-4)
    # bf16 weights: the two reductions (all-reduce, reduce-scatter) may round a sum 1 bf16 ulp apart (2 of 512).
    tol = {"rtol": 1e-3, "atol": 1e-4} if precision == "bf16" else {"rtol": 1.6e-2, "atol": 1e-3}
    for key, value in merged_state(ddp).items():
        torch.testing.assert_close(merged_state(fsdp)[key], value, **tol)


@pytest.mark.extended
@pytest.mark.slow
def test_fsdp_evaluation_and_metrics_equal_ddp(four):
    ddp, fsdp = (four.ranks(n) for n in ("ddp-eval", "fsdp-eval"))
    for a, b in zip(ddp, fsdp):
        assert a["validated"].keys() == b["validated"].keys() >= {"val_loss", "val_acc", "val_ppl"}
        for key, value in a["validated"].items():
            assert b["validated"][key] == pytest.approx(value, rel=1e-5), key


@pytest.mark.extended
@pytest.mark.slow
def test_a_short_last_batch_trains_exactly_token_weighted_under_data_parallelism(four):
    ranks = four.ranks("ddp-odd-last-weighted")
    assert len(ranks[0]["losses"]) == 5  # 3 batches of 8 per replica, one of 7, the next epoch's first
    assert_parity(_replica_mean(ranks), *single_device_data_parallel_run(2, clip=CLIP, max_steps=5, samples=61))


@pytest.mark.extended
@pytest.mark.slow
def test_fsdp_refuses_token_weighted_accumulation_on_every_rank(four):
    for r in four.ranks(REFUSED):
        assert r["error"] is not None and "`data_parallel='fsdp'` with `accumulate_grad_batches=2`" in r["error"]


# ---------------------------------------------------------------------------------------------------- checkpoints
def _whole(ranks: list[dict], part: str, dp_rank: int = 0, key: str | None = None) -> dict:
    merged: dict = {}
    for r in ranks:
        if r["dp_rank"] == dp_rank:
            merged.update(r[key][part] if key else r[part])
    return merged


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved", "resumed"),
    [(("saved_two", "ddp-save"), ("four", "fsdp-from-ddp")), (("four", "fsdp-save"), ("resumed_two", "ddp-from-fsdp"))],
    ids=["ddp-save-fsdp-from-ddp", "fsdp-save-ddp-from-fsdp"],
)
def test_checkpoints_resume_across_ddp_and_fsdp_and_data_parallel_sizes(request, saved, resumed):
    saved_ranks, resumed_ranks = (request.getfixturevalue(launch).ranks(name) for launch, name in (saved, resumed))
    for dp_rank in sorted({r["dp_rank"] for r in resumed_ranks}):
        for part in ("state", "optim"):
            before, after = _whole(saved_ranks, part), _whole(resumed_ranks, part, dp_rank, key="resumed")
            assert before.keys() == after.keys()
            assert any(k.endswith(".exp_avg_sq") for k in before) or part == "state"  # Adam's state is there
            for key, value in before.items():
                if isinstance(value, torch.Tensor):
                    torch.testing.assert_close(after[key], value, rtol=0, atol=0, msg=key)
                else:
                    assert after[key] == value, key
    assert all(len(r["losses"]) == 1 for r in resumed_ranks)  # it trained on from step 3 to step 4


# ---------------------------------------------------------------------------------------------------- nodes
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("inner", ["dp", "pp"])
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_nodes_keep_the_inner_axis_inside_a_node(nodes, inner, mode):
    ranks = nodes.ranks(f"nodes-{inner}-{mode}")
    assert sorted(r["global_rank"] for r in ranks) == [0, 1, 2, 3]
    for r in ranks:
        assert r["node_rank"] == r["global_rank"] // 2
        inside, across = (r["dp_group"], r["pp_group"]) if inner == "dp" else (r["pp_group"], r["dp_group"])
        assert {g // 2 for g in inside} == {r["node_rank"]}  # the inner axis never leaves the node
        assert {g // 2 for g in across} == {0, 1}  # the other one spans both nodes
    assert_parity(_replica_mean(ranks), *single_device_data_parallel_run(2, accumulate=2, clip=CLIP))
