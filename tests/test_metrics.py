"""torchmetrics under pipelining equal one device: MetricCollection (nested, prefixes/postfixes, compute groups, logged
as a collection and as its forward output), MeanMetric, MaxMetric, ClasswiseWrapper and a ``full_state_update=True``
metric, per step and per epoch, in training and validation, at 2 and 4 processes."""

from __future__ import annotations

import functools

import pytest

from tests.launch import SHARED_FOUR, SHARED_TWO, Launch
from tests.metric_models import fit_metrics_model

CONFIGS = {
    2: [
        {"name": "1F1B-2", "schedule": "1F1B", "devices": 2},
        {"name": "ZBV-2", "schedule": "ZBVZeroBubble", "devices": 2},
    ],
    4: [
        {"name": "1F1B-4", "schedule": "1F1B", "devices": 4},
        {"name": "Interleaved-4", "schedule": "Interleaved1F1B", "devices": 4},
    ],
}
TOL = 1e-5
#: the acceptance project at 4 processes (tests/test_project.py), run by this file's 4-process launch
PROJECT_4 = {"name": "project-Interleaved-4", "schedule": "Interleaved1F1B", "devices": 4, "n_layer": 8}


@functools.cache
def _reference() -> dict:
    trainer, model = fit_metrics_model(devices=1)
    return {"records": model.records, "final": {k: float(v) for k, v in trainer.callback_metrics.items()}}


SHARED_TWO.part(__name__, "two_procs", "metrics_parity.py", CONFIGS[2])


@pytest.fixture(scope="module")
def two_procs(request) -> Launch:
    return SHARED_TWO.launch(request)  # the 2-process launch shared with other modules (tests/launch.py Shared)


SHARED_FOUR.part(__name__, "four_procs", "metrics_parity.py", [*CONFIGS[4], PROJECT_4])


@pytest.fixture(scope="module")
def four_procs(request) -> Launch:
    return SHARED_FOUR.launch(request)  # the 4-process launch shared with other modules (tests/launch.py Shared)


def _assert_same(ranks: list[dict], expected: dict) -> None:
    # Per-step values of sum-state metrics are exact up to float order; 1e-5 absolute covers the summation order.
    for r in ranks:
        assert len(r["records"]) == len(expected["records"]) == 6
        for step, (got, want) in enumerate(zip(r["records"], expected["records"])):
            assert got.keys() == want.keys(), step
            for key in want:
                assert got[key] == pytest.approx(want[key], abs=TOL), (step, key)
        assert r["final"].keys() == expected["final"].keys()
        for key in expected["final"]:
            assert r["final"][key] == pytest.approx(expected["final"][key], abs=TOL), key


def _keys_logged(expected: dict) -> None:
    keys = set(expected["final"])
    # collection forward output (nested + prefix), metric objects, classwise, full-state, collection logged whole
    assert {"train_acc", "train_nested_inner_f1", "train_mean", "train_max", "train_full", "train_acc_c0"} <= keys
    assert {"val_acc_epoch", "val_nested_inner_f1_epoch", "val_recall_epoch", "val_mean", "val_acc_c3"} <= keys


@pytest.mark.slow
@pytest.mark.parametrize("name", [c["name"] for c in CONFIGS[2]])
def test_metrics_two_processes(two_procs, name):
    expected = _reference()
    _keys_logged(expected)
    _assert_same(two_procs.ranks(name), expected)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("name", [c["name"] for c in CONFIGS[4]])
def test_metrics_four_processes(four_procs, name):
    _assert_same(four_procs.ranks(name), _reference())


@pytest.mark.extended
@pytest.mark.slow
def test_the_unmodified_project_under_interleaved_1f1b_equals_one_device(four_procs, tmp_path_factory):
    from tests.test_project import assert_same_as_one_device, reference

    expected = reference(str(tmp_path_factory.mktemp("project-reference-8")), PROJECT_4["n_layer"])
    assert_same_as_one_device(four_procs.ranks(PROJECT_4["name"]), expected)


def test_step_values_would_differ_without_the_batch_value():
    """The per-step comparison is not vacuous: the last microbatch's own value differs from the batch's (the pipeline
    logged the former before step values were settled on the full batch; with the step values disabled the tests
    above fail, first on `train_mean` at step 0: 3.5960 instead of 3.6664)."""
    import torch
    from torchmetrics.classification import MulticlassF1Score

    from tests.models import VOCAB

    target = torch.arange(16) % VOCAB
    preds = torch.nn.functional.one_hot(torch.where(torch.arange(16) < 8, target, (target + 1) % VOCAB), VOCAB)
    batch = MulticlassF1Score(VOCAB, average="micro")(preds.float(), target)
    last = MulticlassF1Score(VOCAB, average="micro")(preds[8:].float(), target[8:])
    assert float(batch) == 0.5 and float(last) == 0.0
