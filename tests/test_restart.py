"""A rank SIGKILLed mid-run, its launcher restarting every rank, the restarted ``fit`` resuming by itself: the run
ends as if never interrupted (tests/restarts.py; the full loop is tests/restart_loop.py). Slow: each run starts its
processes twice."""

from __future__ import annotations

import pytest

from tests.restarts import compare, reference, run
from tests.scripts.restart import EVERY

pytestmark = [pytest.mark.slow, pytest.mark.extended]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("restart"), 2)


@pytest.mark.parametrize(
    "launcher,cfg",
    [
        # torchrun --max-restarts=3; asynchronous saves; killed inside its stage's forward of step 14
        ("torchrun", {"devices": 2, "async": True, "kill": {"rank": 1, "step": 14, "where": "step"}}),
        # Lightning's launcher, max_restarts=3; killed while writing its shards of the step-15 checkpoint in the thread
        ("lightning", {"devices": 2, "async": True, "kill": {"rank": 0, "step": 11, "where": "write"}}),
    ],
    ids=["torchrun-step", "lightning-async-write"],
)
def test_a_killed_rank_is_restarted_and_the_run_ends_as_if_uninterrupted(uninterrupted, tmp_path, launcher, cfg):
    proc = run(tmp_path, cfg, launcher)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    outcome = compare(tmp_path, uninterrupted, 2)
    assert outcome.problems == [], (proc.stdout + proc.stderr)[-4000:]
    assert outcome.attempts == 2 and outcome.resumed_from == 10
    assert 0 <= outcome.recomputed <= EVERY
    assert "restart 1: resuming `fit` from" in proc.stdout + proc.stderr
