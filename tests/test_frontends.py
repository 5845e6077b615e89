"""Every supported way of cutting a network trains exactly like one device: nn.Sequential, a block stack on a
child or on the LightningModule itself, torch's tracer on unmodified litgpt, meta-device init, explicit balance and
split points, microbatch size, bf16 precisions, a one-process pipeline, and two "nodes"."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.launch import SCRIPTS, Launch, clean_env, free_port, run_command, run_scenarios
from tests.reference import assert_parity, single_device_model_run

# Starts processes: left out of the fast tier (`pytest -m 'not slow'`).
pytestmark = pytest.mark.slow

TWO_PROC_CONFIGS = [
    {"name": "mlp", "model": "mlp", "devices": 2},
    {"name": "flat", "model": "flat", "devices": 2},
    {"name": "litgpt", "model": "litgpt", "devices": 2, "frontend": "trace"},
    {"name": "litgpt-4stages", "model": "litgpt", "devices": 2, "frontend": "trace", "schedule": "Interleaved1F1B"},
    {"name": "meta", "model": "lm-meta", "devices": 2},
    {"name": "uneven", "model": "lm5", "devices": 2, "balance": [1, 4]},
    {"name": "split-points", "model": "lm5", "devices": 2, "split_points": ["layers.3"], "schedule": "GPipe"},
    {"name": "microbatch-size", "model": "lm", "devices": 2, "microbatch_size": 2},
    {"name": "train-metric", "model": "lm-metric", "devices": 2, "schedule": "ZBVZeroBubble", "max_steps": 12},
    {"name": "short-last-batch", "model": "lm-short-last", "devices": 2, "schedule": "ZBVZeroBubble", "max_steps": 10},
    # the last batch of 5 samples: 5 microbatches of 1 under 1F1B (2 do not divide it), 1 of 5 under Interleaved1F1B
    # (4 do not divide it, 5 are not whole rounds of 2)
    {"name": "odd-last-1F1B", "model": "lm-odd-last", "devices": 2, "microbatches": 2, "max_steps": 9},
    {
        "name": "odd-last-interleaved",
        "model": "lm-odd-last",
        "devices": 2,
        "schedule": "Interleaved1F1B",
        "max_steps": 9,
    },
    {"name": "bf16-mixed", "model": "lm", "devices": 2, "precision": "bf16-mixed"},
    {"name": "bf16-true", "model": "lm", "devices": 2, "precision": "bf16-true"},
    {"name": "tied-modules", "model": "tied", "devices": 2},
    {"name": "tied-trace", "model": "tied", "devices": 2, "frontend": "trace"},
    {"name": "tied-trace-v", "model": "tied", "devices": 2, "frontend": "trace", "schedule": "ZBVZeroBubble"},
]
ONE_PROC_CONFIGS = [
    {"name": "single-lm", "model": "lm", "devices": 1},
    {"name": "single-meta", "model": "lm-meta", "devices": 1},
    {"name": "single-zbv-like", "model": "lm", "devices": 1, "schedule": "Interleaved1F1B"},
]


@pytest.fixture(scope="module")
def two_procs(tmp_path_factory) -> Launch:
    pytest.importorskip("litgpt")
    out = tmp_path_factory.mktemp("frontends2")
    return run_scenarios("frontends.py", out, TWO_PROC_CONFIGS, nprocs=2, launcher="torchrun")


@pytest.fixture(scope="module")
def one_proc(tmp_path_factory) -> Launch:
    out = tmp_path_factory.mktemp("frontends1")
    return run_scenarios("frontends.py", out, ONE_PROC_CONFIGS, nprocs=1, launcher="lightning")


@pytest.mark.parametrize(
    "name, model",
    [
        ("mlp", "mlp"),
        ("flat", "flat"),
        ("litgpt", "litgpt"),
        ("litgpt-4stages", "litgpt"),
        ("microbatch-size", "lm"),
        ("tied-modules", "tied"),
        ("tied-trace", "tied"),
        ("tied-trace-v", "tied"),
    ],
)
def test_frontend_parity(two_procs, name, model):
    ranks = two_procs.ranks(name)
    assert_parity(ranks, *single_device_model_run(model))


def test_short_last_batch_gets_its_own_schedule(two_procs):
    """A smaller final batch changes microbatch shapes; it must train exactly, not reuse stale stage shapes."""
    ranks = two_procs.ranks("short-last-batch")
    assert len(ranks[0]["losses"]) == 10
    assert_parity(ranks, *single_device_model_run("lm-short-last", max_steps=10))


@pytest.mark.parametrize("name", ["odd-last-1F1B", "odd-last-interleaved"])
def test_a_last_batch_the_microbatches_do_not_divide_trains_exactly(two_procs, name):
    ranks = two_procs.ranks(name)
    assert len(ranks[0]["losses"]) == 9  # 7 batches of 8, one of 5, then the next epoch's first
    assert_parity(ranks, *single_device_model_run("lm-odd-last", max_steps=9))


def test_training_metric_objects_reach_every_rank(two_procs):
    """A torchmetrics object called in training_step (last stage only) logs the single-device step and epoch values
    on every rank: rank 0, which under ZBV holds the last stage, and rank 1, which does not."""
    from tests.reference import single_device_model_logged

    losses, state, logged = single_device_model_logged("lm-metric", max_steps=12)
    ranks = two_procs.ranks("train-metric")
    assert_parity(ranks, losses, state)
    for r in ranks:
        for key in ("train_acc_epoch", "train_loss_epoch"):
            assert r["logged"][key] == pytest.approx(logged[key], rel=1e-5), key
        # The step value is the whole batch's, not the last microbatch's (4 microbatches per step here).
        assert r["step_acc"] == pytest.approx(logged["step_acc"], rel=1e-5)


@pytest.mark.parametrize(("name", "first_blocks"), [("uneven", 1), ("split-points", 3)])
def test_uneven_balance_and_split_points(two_procs, name, first_blocks):
    ref = single_device_model_run("lm5")
    ranks = two_procs.ranks(name)
    assert_parity(ranks, *ref)
    layers0 = {k.split(".")[2] for k in ranks[0]["state"] if k.startswith("model.layers.")}
    assert layers0 == {str(i) for i in range(first_blocks)}
    assert "model.embed.weight" in ranks[0]["state"] and "model.head.weight" in ranks[1]["state"]


def test_meta_init_is_independent_of_pipeline_layout(two_procs, one_proc):
    """configure_model on the meta device: each rank materializes its stage; the weights do not depend on the layout."""
    two = two_procs.ranks("meta")
    one = one_proc.ranks("single-meta")
    assert_parity(two, one[0]["losses"], one[0]["state"])


@pytest.mark.parametrize("name", ["single-lm", "single-zbv-like"])
def test_one_process_pipeline_matches_single_device(one_proc, name):
    ref = single_device_model_run("lm")
    assert_parity(one_proc.ranks(name), *ref)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_precisions(two_procs, precision):
    ranks = two_procs.ranks(precision)
    ref_losses, _ = single_device_model_run("lm", precision=precision)
    # bf16 rounding depends on matmul shapes (microbatches), so parity is loose; fp32 parity is tested exactly.
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=2e-2, atol=2e-2)
        assert r["dtypes"] == (["torch.bfloat16"] if precision == "bf16-true" else ["torch.float32"])


def test_two_nodes(tmp_path):
    """num_nodes=2 with one process each, started per node with NODE_RANK as Lightning's launcher expects."""
    cfg = [{"name": "nodes", "schedule": "1F1B", "devices": 1, "num_nodes": 2}]
    port = str(free_port())
    command = [sys.executable, str(SCRIPTS / "parity.py"), str(tmp_path), json.dumps(cfg)]
    envs = [clean_env(NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for node in (0, 1)]
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda env: run_command(command, env, timeout=300), envs))
    assert [p.returncode for p in procs] == [0, 0], procs[0].stderr[-3000:] + procs[1].stderr[-3000:]
    from tests.reference import single_device_run

    ranks = Launch(tmp_path, 2, procs[0]).ranks("nodes")
    assert [r["pipeline_rank"] for r in ranks] == [0, 1]
    assert_parity(ranks, *single_device_run())
