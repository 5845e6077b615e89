"""A pipelined run shows the progress bar one device shows: same fields, same values (the last stage's loss),
with Lightning's default TQDM bar and with ``RichProgressBar``."""

from __future__ import annotations

import math

import pytest

from tests.launch import Launch, run_scenarios
from tests.progress import run

BARS = ["tqdm", "rich"]
TOL = 1e-5


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Launch:
    out = tmp_path_factory.mktemp("progress")
    return run_scenarios("progress_bar.py", out, [{"name": bar} for bar in BARS], nprocs=2, launcher="lightning")


def _close(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, float) and isinstance(y, float):
            if not math.isclose(x, y, rel_tol=TOL, abs_tol=TOL):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("bar", BARS)
def test_the_bar_shows_what_one_device_shows(pipeline, tmp_path, bar):
    single = run(bar, tmp_path)
    ranks = pipeline.ranks(bar)
    shown = ranks[0]["shown"]
    # The bar renders on global rank 0 (stage 0, which never computes the loss itself), as often as on one device.
    assert len(shown) == len(single["shown"]) > 8
    for got, want in zip(shown, single["shown"]):
        assert (got["stage"], got["step"]) == (want["stage"], want["step"])
        assert _close(got["metrics"], want["metrics"]), (got, want)
    keys = set().union(*(s["metrics"] for s in shown))
    assert {"v_num", "train_loss", "train_acc", "val_loss"} <= keys
    # Every rank holds the same values the bar shows (the last stage's loss and logs, replayed).
    assert _close(ranks[0]["progress_bar_metrics"], single["progress_bar_metrics"])
    assert _close(ranks[1]["progress_bar_metrics"], ranks[0]["progress_bar_metrics"])
