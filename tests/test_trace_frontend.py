"""``frontend="trace"``: an unmodified network, cut by torch's tracer, trains exactly like the module-surgery cut."""

import pytest
import torch

from tests.launch import run_script

# Starts processes: left out of the fast tier (`pytest -m 'not slow'`); the extended tier (a 50-s launch).
pytestmark = [pytest.mark.slow, pytest.mark.extended]


def test_trace_frontend_matches_modules_frontend(tmp_path) -> None:
    run_script("trace_frontend.py", str(tmp_path), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for result in ranks:
        assert result["trace"]["losses"] == pytest.approx(result["modules"]["losses"], rel=1e-5)
        # the traced stages keep the full model's parameter names
        assert result["trace"]["names"] == result["modules"]["names"]
    assert "model.embed.weight" in ranks[0]["trace"]["names"]
    assert "model.head.weight" in ranks[1]["trace"]["names"]
    assert len(ranks[0]["trace"]["losses"]) == 4
