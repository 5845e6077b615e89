"""The tests' own habits: a failing scenario of a shared launch fails its own tests and no
other's; an error-message test matches the names and values the message must carry, not its wording."""

from __future__ import annotations

import subprocess

import pytest
import torch

from tests.launch import Launch
from tests.scripts.outcomes import run_each


def _scenario(out, cfg):
    if cfg["name"] == "broken":
        raise ValueError(f"no such layer: {cfg['layer']!r}")
    torch.save({"name": cfg["name"]}, out / f"{cfg['name']}.rank0.pt")


def test_a_failing_scenario_fails_its_own_test_and_the_launch_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    configs = [{"name": "first"}, {"name": "broken", "layer": "mlp.fc9"}, {"name": "after"}]
    run_each(tmp_path, configs, _scenario)
    launch = Launch(tmp_path, 1, subprocess.CompletedProcess([], 0, "", ""))
    assert [r["name"] for r in launch.ranks("first") + launch.ranks("after")] == ["first", "after"]
    with pytest.raises(pytest.fail.Exception) as failed:
        launch.ranks("broken")
    assert "scenario broken failed" in str(failed.value) and "ValueError: no such layer: 'mlp.fc9'" in str(failed.value)


def test_a_scenario_the_launch_never_reached_fails_with_the_launch_output(tmp_path):
    launch = Launch(tmp_path, 2, subprocess.CompletedProcess([], -9, "step 3 of 6", "killed after 600 s"))
    with pytest.raises(pytest.fail.Exception) as failed:
        launch.ranks("late")
    message = str(failed.value)
    assert "late.rank0.pt" in message and "exited -9" in message and "killed after 600 s" in message
