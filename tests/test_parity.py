"""Exact loss and parameter parity between single-device training and pipeline training (2 and 4 processes)."""

from __future__ import annotations

import pytest

from tests.launch import SHARED_FOUR, SHARED_TWO, Launch
from tests.reference import assert_data_parallel_parity, assert_parity, single_device_run

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"]
CLIP = 0.05


def _configs(devices: int) -> list[dict]:
    configs = []
    for schedule in SCHEDULES:
        configs.append({"name": f"{schedule}-plain", "schedule": schedule, "devices": devices})
        configs.append(
            {"name": f"{schedule}-acc2-clip", "schedule": schedule, "devices": devices, "accumulate": 2, "clip": CLIP}
        )
    if devices == 2:
        configs.append({"name": "sabotage", "schedule": "1F1B", "devices": 2, "sabotage": True})
        configs.append({"name": "sabotage-zbv", "schedule": "ZBVZeroBubble", "devices": 2, "sabotage": True})
    if devices == 4:
        # 2 pipelines of 2 stages: data parallel x pipeline parallel.
        configs.append(
            {"name": "dp2-pp2", "schedule": "1F1B", "devices": 4, "pipeline_size": 2, "accumulate": 2, "clip": CLIP}
        )
    return configs


# The launches' results, collected once per module: each test reads its own config's (Launch.ranks).
SHARED_TWO.part(__name__, "two_procs", "parity.py", _configs(2))


@pytest.fixture(scope="module")
def two_procs(request) -> Launch:
    # Lightning's own launcher: the script re-runs itself as rank 1.
    return SHARED_TWO.launch(request)  # the 2-process launch shared with other modules (tests/launch.py Shared)


SHARED_FOUR.part(__name__, "four_procs", "parity.py", _configs(4))


@pytest.fixture(scope="module")
def four_procs(request) -> Launch:
    return SHARED_FOUR.launch(request)  # the 4-process launch shared with other modules (tests/launch.py Shared)


def _reference(cfg: dict):
    return single_device_run(accumulate=cfg.get("accumulate", 1), clip=cfg.get("clip"))


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [c for c in _configs(2) if not c.get("sabotage")], ids=lambda c: c["name"])
def test_two_process_parity(two_procs, cfg):
    ranks = two_procs.ranks(cfg["name"])
    assert len(ranks) == 2
    assert_parity(ranks, *_reference(cfg))
    # Every rank logs the same key with the last stage's value.
    assert {r["logged"]["train_loss"] for r in ranks} == {ranks[0]["logged"]["train_loss"]}


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("cfg", [c for c in _configs(4) if "pipeline_size" not in c], ids=lambda c: c["name"])
def test_four_process_parity(four_procs, cfg):
    ranks = four_procs.ranks(cfg["name"])
    assert len(ranks) == 4
    assert_parity(ranks, *_reference(cfg))


@pytest.mark.extended
@pytest.mark.slow
def test_data_parallel_pipelines_match_one_device_on_the_global_batch(four_procs):
    """2 replicas x 2 stages: each replica trains on its shard; averaged gradients equal one device on both shards."""
    assert_data_parallel_parity(four_procs.ranks("dp2-pp2"), accumulate=2, clip=CLIP)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sabotage", "sabotage-zbv"])
def test_parity_check_catches_dropped_stage_gradients(two_procs, name):
    """The parity comparison is not vacuous: losing one stage's gradients breaks it."""
    ranks = two_procs.ranks(name)
    with pytest.raises(AssertionError):
        assert_parity(ranks, *single_device_run())


def test_clipping_is_active_in_the_reference():
    """Clipping at CLIP changes the single-device run, so the clipped parity configs exercise the global norm."""
    clipped, _ = single_device_run(accumulate=2, clip=CLIP)
    unclipped, _ = single_device_run(accumulate=2)
    assert clipped[:2] == unclipped[:2]  # before the first optimizer step the runs agree
    assert abs(clipped[-1] - unclipped[-1]) > 1e-4
