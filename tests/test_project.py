"""The issue's acceptance project (tests/project_models.py: a char-level GPT written for one device, a short last
batch, shuffling, MetricCollection clones and MeanMetric, AdamW with a per-step LambdaLR, LearningRateMonitor,
ModelCheckpoint, clipping, accumulation, then test from the best checkpoint and predict) under the pipeline with only
``import lightning_pipe``, ``devices`` and ``strategy``: every logged value of every step, the test metrics and the
predictions equal one device within rtol 1e-5. The 4-process Interleaved1F1B run joins the metric parity's 4-process
launch (tests/test_metrics.py); Lightning's demo transformer joins this file's 2-process launch."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.demo_models import fit_boring, fit_demo_model, fit_demo_transformer, fit_manual
from tests.launch import SHARED_TWO, Launch
from tests.project_models import TRAIN, run_project
from tests.reference import merged_state

TOL = 1e-5
CONFIGS = [
    {"name": "default", "devices": 2},  # strategy="pipeline": frontend "auto" (dataflow here), 1F1B
    {"name": "1F1B-4", "devices": 2, "schedule": "1F1B", "microbatches": 4},
    {"name": "ZBV", "devices": 2, "schedule": "ZBVZeroBubble"},
    # Lightning's demo transformer with only strategy="pipeline": batches of one sample, which 1F1B on 2 stages hands
    # to GPipe (1F1B needs a microbatch per stage)
    {"name": "demo-transformer", "devices": 2, "demo": 1},
    # Lightning's one-Linear demos: the first stage runs the Linear, the second passes its output on
    {"name": "boring", "devices": 2, "demo": "boring"},  # batches of one sample: GPipe, one microbatch
    {"name": "demo-model", "devices": 2, "demo": "demo-model"},  # 1F1B, batches of 4 in 2 microbatches
    {"name": "demo-model-GPipe", "devices": 2, "demo": "demo-model", "schedule": "GPipe", "microbatches": 2},
    {"name": "demo-model-ZBV", "devices": 2, "demo": "demo-model", "schedule": "ZBVZeroBubble", "microbatches": 2},
    {"name": "demo-model-I1F1B", "devices": 2, "demo": "demo-model", "schedule": "Interleaved1F1B", "microbatches": 2},
    # manual optimization: ManualOptimBoringModel (batches of one sample), and accumulating over 2 batches of 4 (1F1B,
    # 2 microbatches) with clipping and a scheduler
    {"name": "manual", "devices": 2, "demo": "manual"},
    {"name": "manual-accumulating", "devices": 2, "demo": "manual", "every": 2},
]


@functools.cache
def reference(root: str, n_layer: int = 4) -> dict:
    """The project on one device (in the pytest process)."""
    return run_project(Path(root), n_layer, devices=1)


def assert_same_as_one_device(ranks: list[dict], expected: dict) -> None:
    """Every rank's logged history (step by step), final callback metrics, best checkpoint, test metrics; rank 0's
    predictions (the other ranks return Nones, as documented)."""
    assert TRAIN % 16 and len(expected["history"]) == 22  # a short last batch; lr, step, epoch and test records
    for rank in ranks:
        assert [s for s, _ in rank["history"]] == [s for s, _ in expected["history"]]
        for index, ((_, got), (_, want)) in enumerate(zip(rank["history"], expected["history"])):
            assert got.keys() == want.keys(), index
            for key in want:
                assert got[key] == pytest.approx(want[key], rel=TOL, abs=1e-7), (index, key)
        for found in ("fitted", "test"):
            assert rank[found].keys() == expected[found].keys()
            for key in expected[found]:
                assert rank[found][key] == pytest.approx(expected[found][key], rel=TOL, abs=1e-7), (found, key)
        assert rank["best_name"] == expected["best_name"]
        assert rank["best_score"] == pytest.approx(expected["best_score"], rel=TOL)
    torch.testing.assert_close(ranks[0]["predictions"], expected["predictions"], rtol=TOL, atol=1e-7)
    assert all(rank["predictions"] is None for rank in ranks[1:])


SHARED_TWO.part(__name__, "two_procs", "project.py", CONFIGS)


@pytest.fixture(scope="module")
def two_procs(request) -> Launch:
    return SHARED_TWO.launch(request)  # the 2-process launch shared with other modules (tests/launch.py Shared)


@pytest.mark.slow
@pytest.mark.parametrize("name", [c["name"] for c in CONFIGS if "demo" not in c])
def test_the_unmodified_project_equals_one_device(two_procs, name, tmp_path_factory):
    expected = reference(str(tmp_path_factory.mktemp("project-reference")))
    assert {"train/loss_step", "train/acc_epoch", "val/loss", "val/acc", "lr-AdamW"} <= {
        key for _, logged in expected["history"] for key in logged
    }
    assert_same_as_one_device(two_procs.ranks(name), expected)


@pytest.mark.slow
def test_lightning_demo_transformer_under_the_default_strategy_equals_one_device_bitwise(two_procs):
    # Bitwise needs the ranks' op sequence: one thread, as the launched ranks have (OMP_NUM_THREADS=1). A one-process
    # Trainer earlier in this process may have set 2 (Lightning's launcher does where OMP_NUM_THREADS is unset), and
    # the demo's numerics amplify the other summation order (4.3119 against 4.3135 at the fourth step).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = fit_demo_transformer(devices=1)
    finally:
        torch.set_num_threads(threads)
    ranks = two_procs.ranks("demo-transformer")
    assert all(rank["losses"] == expected["losses"] for rank in ranks) and len(expected["losses"]) == 4
    state = merged_state([{**rank, "dp_rank": 0} for rank in ranks])
    assert state.keys() == expected["state"].keys()
    assert all(torch.equal(state[k], v) for k, v in expected["state"].items())


def _one_thread(fn, *args, **kwargs):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the launched ranks' op sequence (see the demo transformer's test)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_lightning_boring_model_fits_checkpoints_resumes_and_predicts_as_one_device_bitwise(two_procs, tmp_path):
    # One Linear on 2 stages: the second passes the output on and holds no parameter (its optimizer's groups are
    # empty, its checkpoint shard has no weights). Batches of one sample: one microbatch; one device is the reference.
    expected = _one_thread(fit_boring, tmp_path, devices=1)
    ranks = two_procs.ranks("boring")
    assert len(expected["first"]["losses"]) == 8 and len(expected["losses"]) == 4
    for rank in ranks:
        assert rank["first"]["losses"] == expected["first"]["losses"]
        assert rank["losses"] == expected["losses"]  # resumed from the pipeline's own ModelCheckpoint
        assert rank["test"] == expected["test"]
        # StepLR resumed on both ranks: the pass-on rank's empty param group reads the Linear's saved hyperparameters
        assert rank["lr"] == expected["lr"]
    for found in ("first", None):
        got = [(r["first"] if found else r) for r in ranks]
        state = merged_state([{**r, "dp_rank": 0} for r in got])
        want = expected["first"]["state"] if found else expected["state"]
        assert state.keys() == want.keys() and all(torch.equal(state[k], v) for k, v in want.items())
    assert ranks[1]["state"] == {}  # the pass-on stage holds nothing
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["predictions"], expected["predictions"], strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", [c["name"] for c in CONFIGS if c.get("demo") == "demo-model"])
def test_lightning_demo_model_equals_one_device_accumulating_the_microbatches_bitwise(two_procs, name):
    # DemoModel's loss is the batch's sum: the pipeline equals one device accumulating the same 2 microbatches (its
    # loss the mean of theirs: Lightning's accumulation divides each by 2), parameters and predictions bitwise.
    expected = _one_thread(fit_demo_model, batch_size=2, accumulate_grad_batches=2, devices=1)
    per_step = [expected["losses"][2 * i] + expected["losses"][2 * i + 1] for i in range(4)]
    ranks = two_procs.ranks(name)
    for rank in ranks:
        assert rank["losses"] == pytest.approx(per_step, rel=1e-6)
    state = merged_state([{**r, "dp_rank": 0} for r in ranks])
    assert state.keys() == expected["state"].keys()
    assert all(torch.equal(state[k], v) for k, v in expected["state"].items())
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["predictions"], expected["predictions"], strict=True))


@pytest.mark.slow
def test_lightning_manual_optimization_demo_equals_one_device(two_procs):
    # The step's zero_grad, manual_backward and step (and clip_gradients, the scheduler) are recorded on the last
    # stage, which holds no parameter here, and done on both ranks after the schedule. One microbatch: bitwise.
    expected = _one_thread(fit_manual, devices=1)
    ranks = two_procs.ranks("manual")
    assert len(expected["losses"]) == 4
    for rank in ranks:
        assert rank["losses"] == expected["losses"] and rank["global_step"] == 4
    state = merged_state([{**r, "dp_rank": 0} for r in ranks])
    assert state.keys() == expected["state"].keys()
    assert all(torch.equal(state[k], v) for k, v in expected["state"].items())
    # Gradients accumulated over 2 batches of 2 microbatches each, clipped by the norm over both stages (a collective
    # both ranks join), stepped, zeroed, the scheduler stepped: one device up to the order of float sums.
    expected = _one_thread(fit_manual, batch_size=4, every=2, devices=1)
    ranks = two_procs.ranks("manual-accumulating")
    assert len(expected["losses"]) == 8 and expected["lr"] == pytest.approx([0.1 * 0.1**4])
    for rank in ranks:
        assert rank["losses"] == pytest.approx(expected["losses"], rel=1e-6)
        assert rank["lr"] == expected["lr"] and rank["global_step"] == 4
    state = merged_state([{**r, "dp_rank": 0} for r in ranks])
    for key, value in expected["state"].items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------------ one process
def _epoch_mean(batches: list[list[float]], sizes_of: list[list[int]], weighted: bool = False) -> tuple:
    """A ``MeanMetric`` called once per microbatch (as the pipeline's last stage calls the user's step) inside
    :meth:`MetricMirror.step`; its epoch value and each step's settled value."""
    from torch import nn
    from torchmetrics import MeanMetric

    from lightning_pipe.step.metrics import MetricMirror

    module = nn.Module()
    module.loss = MeanMetric()
    mirror = MetricMirror(module)
    step_values = []
    for values, sizes in zip(batches, sizes_of):
        with mirror.step(record_step_values=len(sizes) > 1, sizes=sizes) as metrics:
            for m, value in enumerate(values):
                metrics.enter(m)
                weight = (float(sizes[m]),) if weighted else ()
                module.loss(torch.tensor(value), *weight)
            metrics.settle()
        step_values.append(float(metrics.step_values.get("loss", module.loss.compute())))
        assert module.loss.__dict__["update"].__name__ != "weighed"  # torchmetrics' own again after the step
    return float(module.loss.compute()), step_values


def test_a_mean_metric_of_the_loss_counts_one_observation_per_batch_whatever_its_microbatches():
    # Two full batches in 2 microbatches of 8 and a short last batch of 9 in 9 microbatches of 1: on one device the
    # epoch mean is the mean of the 3 batch losses; counting microbatches would weigh the last batch 9/13.
    batches = [[1.0, 3.0], [2.0, 2.0], [float(v) for v in range(9)]]
    epoch, steps = _epoch_mean(batches, [[8, 8], [8, 8], [1] * 9])
    assert steps == pytest.approx([2.0, 2.0, 4.0])
    assert epoch == pytest.approx((2.0 + 2.0 + 4.0) / 3)
    # An explicit weight (the microbatch's sample count) is the user's: kept, and exact as it was.
    assert _epoch_mean([[1.0, 3.0], [5.0]], [[4, 4], [2]], weighted=True)[0] == pytest.approx((2 * 8 + 5 * 2) / 10)
