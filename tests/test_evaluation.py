"""Validation, test and predict under pipelining equal single-device runs (2 and 4 processes, CPU/gloo).

Each launch runs several configurations (tests/scripts/evaluation.py); the single-device references run here, in the
pytest process, through the same scenario functions (tests/eval_models.py).
"""

from __future__ import annotations

import csv
import functools
import math
from pathlib import Path

import pytest
import torch

from tests.eval_models import LitNormMLP, run_scenario
from tests.launch import SHARED_FOUR, Launch, run_scenarios

# Starts processes: left out of the fast tier (`pytest -m 'not slow'`).
pytestmark = pytest.mark.slow

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"]
TOL = 1e-5


def _configs(devices: int) -> list[dict]:
    configs = [{"name": f"{s}-full", "scenario": "full", "schedule": s, "devices": devices} for s in SCHEDULES]
    if devices == 2:
        configs += [
            # Explicit microbatch counts: 3 splits the 8-sample batches 3/3/2 and the last 5-sample batch 2/2/1.
            {"name": "1F1B-full-mb3", "scenario": "full", "schedule": "1F1B", "devices": 2, "eval_microbatches": 3},
            {
                "name": "ZBV-full-mb1",
                "scenario": "full",
                "schedule": "ZBVZeroBubble",
                "devices": 2,
                "eval_microbatches": 1,
            },
            {"name": "1F1B-ckpt", "scenario": "ckpt", "schedule": "1F1B", "devices": 2},
            {"name": "ZBV-ckpt", "scenario": "ckpt", "schedule": "ZBVZeroBubble", "devices": 2},
            {"name": "GPipe-norm", "scenario": "norm", "schedule": "GPipe", "devices": 2},
            {"name": "1F1B-trace", "scenario": "trace", "schedule": "1F1B", "devices": 2, "frontend": "trace"},
        ]
    else:
        configs += [
            {"name": "Interleaved-ckpt", "scenario": "ckpt", "schedule": "Interleaved1F1B", "devices": 4},
            {"name": "dp2-pp2", "scenario": "dp", "schedule": "1F1B", "devices": 4, "pipeline_size": 2},
            {"name": "dp2-zbv", "scenario": "dp", "schedule": "ZBVZeroBubble", "devices": 4, "pipeline_size": 2},
        ]
    return configs


@functools.cache
def _reference(scenario: str, root: str) -> dict:
    return run_scenario(scenario, Path(root) / scenario)


@pytest.fixture(scope="module")
def ref_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("eval-ref"))


def _launch(tmp_path_factory, devices: int) -> Launch:
    """One launch of the configs, once per module; each config's test reads its own outcome (Launch.ranks)."""
    out = tmp_path_factory.mktemp(f"eval{devices}")
    return run_scenarios("evaluation.py", out, _configs(devices), nprocs=devices, launcher="torchrun")


@pytest.fixture(scope="module")
def two_procs(tmp_path_factory) -> Launch:
    return _launch(tmp_path_factory, 2)


SHARED_FOUR.part(__name__, "four_procs", "evaluation.py", _configs(4))


@pytest.fixture(scope="module")
def four_procs(request) -> Launch:
    return SHARED_FOUR.launch(request)  # the 4-process launch shared with other modules (tests/launch.py Shared)


def _close_dicts(got: list[dict], ref: list[dict]) -> None:
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.keys() == r.keys()
        for k in r:
            assert math.isclose(g[k], r[k], rel_tol=TOL, abs_tol=1e-7), (k, g[k], r[k])


def _cat(predictions: list, key: str | None = None) -> torch.Tensor:
    return torch.cat([p[key] if key else p for p in predictions])


def _check_full(ranks: list[dict], ref: dict) -> None:
    for r in ranks:
        # Every rank sees the same keys and values as the single-device run: per epoch, in the sanity check, after
        # validate/test, in the outputs returned to on_validation_batch_end.
        _close_dicts(r["epochs"], ref["epochs"])
        _close_dicts(r["sanity"], ref["sanity"])
        _close_dicts(r["validate"], ref["validate"])
        _close_dicts(r["test"], ref["test"])
        assert r["val_outputs"] == pytest.approx(ref["val_outputs"], rel=TOL)
        # Training around validation stays exact (train -> validate -> train).
        assert r["losses"] == pytest.approx(ref["losses"], rel=TOL)
        for k, v in r["state"].items():
            torch.testing.assert_close(v, ref["state"][k], rtol=TOL, atol=1e-6)
    # The predictions reach pipeline rank 0 only, in single-device order and values.
    for r in ranks:
        if r["pipeline_rank"] == 0:
            assert [p["probs"].shape for p in r["predict"]] == [p["probs"].shape for p in ref["predict"]]
            torch.testing.assert_close(_cat(r["predict"], "probs"), _cat(ref["predict"], "probs"), rtol=TOL, atol=1e-6)
            assert torch.equal(_cat(r["predict"], "first"), _cat(ref["predict"], "first"))
        else:
            assert r["predict"] == [None] * len(ref["predict"])


def _read_csv(path: str) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def _check_csv(got_path: str, ref_path: str) -> None:
    got_cols, got_rows = _read_csv(got_path)
    ref_cols, ref_rows = _read_csv(ref_path)
    assert sorted(got_cols) == sorted(ref_cols)
    assert len(got_rows) == len(ref_rows)
    for g, r in zip(got_rows, ref_rows):
        for col in ref_cols:
            if r[col] == "":
                assert g[col] == "", col
            else:
                assert math.isclose(float(g[col]), float(r[col]), rel_tol=TOL, abs_tol=1e-7), (col, g[col], r[col])


def _check_ckpt(ranks: list[dict], ref: dict) -> None:
    for r in ranks:
        _close_dicts(r["epochs"], ref["epochs"])
        assert r["best_k"] == ref["best_k"]
        assert r["best"] == ref["best"]
        assert (r["stopped_epoch"], r["current_epoch"]) == (ref["stopped_epoch"], ref["current_epoch"])


def _check_config(launch: Launch, cfg: dict, ref_root: str) -> None:
    ranks = launch.ranks(cfg["name"])
    ref = _reference(cfg["scenario"], ref_root)
    if cfg["scenario"] == "full":
        _check_full(ranks, ref)
        rank0 = next(r for r in ranks if r["pipeline_rank"] == 0 and r["dp_rank"] == 0)
        _check_csv(rank0["csv"], ref["csv"])
    elif cfg["scenario"] == "ckpt":
        _check_ckpt(ranks, ref)
    elif cfg["scenario"] == "trace":
        for r in ranks:
            _close_dicts(r["validate"], ref["validate"])
        assert [p.shape[0] for p in ranks[0]["predict"]] == [8, 5]
        torch.testing.assert_close(_cat(ranks[0]["predict"]), _cat(ref["predict"]), rtol=TOL, atol=1e-6)
    elif cfg["scenario"] == "norm":
        for r in ranks:
            _close_dicts(r["validate"], ref["validate"])
            assert r["state_unchanged"]
        torch.testing.assert_close(_cat(ranks[0]["predict"]), _cat(ref["predict"]), rtol=TOL, atol=1e-6)
    else:
        _check_dp(ranks, ref)


def _check_dp(ranks: list[dict], ref: dict) -> None:
    for r in ranks:
        _close_dicts(r["validate"], ref["validate"])
        _close_dicts(r["test"], ref["test"])
    ref_probs = _cat(ref["predict"], "probs")
    for r in ranks:
        if r["pipeline_rank"] != 0:
            assert all(p is None for p in r["predict"])
            continue
        # Lightning's predict sampler gives replica k the samples k, k+2, k+4, ...
        got = _cat(r["predict"], "probs")
        torch.testing.assert_close(got, ref_probs[r["dp_rank"] :: 2], rtol=TOL, atol=1e-6)


@pytest.mark.parametrize("cfg", _configs(2), ids=lambda c: c["name"])
def test_two_processes(two_procs, ref_root, cfg):
    _check_config(two_procs, cfg, ref_root)


@pytest.mark.extended
@pytest.mark.parametrize("cfg", _configs(4), ids=lambda c: c["name"])
def test_four_processes(four_procs, ref_root, cfg):
    _check_config(four_procs, cfg, ref_root)


def test_references_are_not_trivial(ref_root):
    """The scenarios exercise what they claim: an uneven last batch, early stopping before max_epochs, dropout."""
    full = _reference("full", ref_root)
    assert [p["probs"].shape[0] for p in full["predict"]] == [8, 8, 5]
    assert full["epochs"][0]["val_acc"] != full["epochs"][1]["val_acc"]
    ckpt = _reference("ckpt", ref_root)
    assert 0 < ckpt["stopped_epoch"] < 7
    assert not any(name.startswith(f"epoch={ckpt['stopped_epoch']}-") for name in ckpt["best_k"])
    # Dropout and batch statistics would change the norm model's outputs: eval mode is what makes them match.
    model = LitNormMLP()
    x = next(iter(model.predict_dataloader()))[0]
    assert not torch.allclose(model.train()(x), model.eval()(x))
