"""The fault matrix of recovery in place (docs/reliability.md, "Kill points"): a rank SIGKILLed at each kill point
(inside a training step, during validation, while a snapshot serialises, as it starts the exchange with its buddy,
while a disk checkpoint is written), on each rank, for each layout.

The cases are named ``<layout>-<kill point>-rank<R>`` in the test report. Several cases share one launch (five kills
in one run, one per generation; ``max_restarts=5``), and every launch of a layout is compared with one reference
run of that layout, made once: each case checks its own kill (the replacement, the survivors' processes, the snapshot
step resumed from) and its launch's exactness (every training and validation loss and the final weights bit for bit
equal to the reference's), that no checkpoint file was read, and that the checkpoint a kill interrupted was written
again, complete. A launch is bounded by its timeout (``LAUNCH_TIMEOUT``); a hang fails its cases.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lightning_pipe.checkpoint.format import is_transient
from lightning_pipe.checkpoint.latest import inspect_complete
from tests.restarts import Outcome, compare, run, uninterrupted

#: Seconds one launch of the matrix may take (five kills and recoveries).
LAUNCH_TIMEOUT = 420
#: The snapshot interval of every launch.
EVERY = 4

#: The layouts of the matrix: the processes of a run (``"2x2"``: 2 stages x 2 data-parallel replicas; ranks 0 and 1
#: hold stage 0 of replicas 0 and 1, ranks 2 and 3 stage 1; each rank's buddy is the same stage in the other replica).
LAYOUTS: dict[str, dict[str, Any]] = {"2stages": {"devices": 2}, "2x2": {"devices": 4}}


@dataclass(frozen=True)
class Kill:
    """One case: ``rank`` SIGKILLed at ``where`` of training step ``step`` (for ``validation``: in the validation
    after it), in ``generation``; the run resumes from the snapshot of ``resumes_from``."""

    where: str
    rank: int
    step: int
    generation: int
    resumes_from: int

    def config(self) -> dict[str, Any]:
        return {"where": self.where, "rank": self.rank, "step": self.step, "generation": self.generation}


#: Launches of the 2-stage layout: every kill point on one rank per launch, one kill per generation (each after the
#: previous recovery; ``max_restarts=5``), the two launches with the ranks swapped, one with a spare (renewed after
#: each use), one with new processes. ``serialise`` at step 12: the snapshot of 12 is on no buddy, every rank agrees on
#: 8; ``exchange`` at 16: the survivor's own copy of 16 is dropped, every rank agrees on 12; ``write`` at 20: the disk
#: save of step 20 (``ModelCheckpoint`` every 5 steps) is interrupted.
LAUNCHES: dict[str, dict[str, Any]] = {
    f"2stages-{first}": {
        "spares": spares,
        "kills": [
            Kill("step", first, 6, 0, 4),
            Kill("validation", 1 - first, 10, 1, 8),
            Kill("serialise", first, 12, 2, 8),
            Kill("exchange", 1 - first, 16, 3, 12),
            Kill("write", first, 20, 4, 16),
        ],
    }
    for first, spares in ((0, 1), (1, 0))
}
#: The launch of the 2 x 2 layout: the kill points alternate between rank 2 (stage 1 of replica 0) and rank 1 (stage
#: 0 of replica 1), so that every point is hit once and both stages and both replicas lose a rank; ``write`` on rank 2:
#: only the first replica's ranks write checkpoint files. A spare takes each place (renewed after each use). The same
#: steps, so the same snapshots resumed from, as the 2-stage launches.
LAUNCHES["2x2-alternating"] = {
    "spares": 1,
    "kills": [
        Kill("step", 2, 6, 0, 4),
        Kill("validation", 1, 10, 1, 8),
        Kill("serialise", 2, 12, 2, 8),
        Kill("exchange", 1, 16, 3, 12),
        Kill("write", 2, 20, 4, 16),
    ],
}

CASES = [
    pytest.param(name, i, id=f"{name.split('-')[0]}-{kill.where}-rank{kill.rank}")
    for name, launch in LAUNCHES.items()
    for i, kill in enumerate(launch["kills"])
]


@dataclass
class Launched:
    out: Path
    output: str
    returncode: int
    outcome: Outcome


class Launches:
    """Each layout's reference and each launch, run once for all the cases that read them."""

    def __init__(self, root: Path, shared: Path) -> None:
        self.root, self.shared = root, shared
        self.launched: dict[str, Launched] = {}

    def reference(self, layout: str) -> Path:
        """The uninterrupted run of ``layout``, shared with tests/test_recovery.py (made by whichever runs first)."""
        return uninterrupted(self.shared, LAYOUTS[layout]["devices"], timeout=LAUNCH_TIMEOUT)

    def launch(self, name: str) -> Launched:
        if name not in self.launched:
            layout, launch = name.split("-")[0], LAUNCHES[name]
            reference = self.reference(layout)
            cfg = {
                **LAYOUTS[layout],
                "snapshot_every": EVERY,
                "spares": launch["spares"],
                "kills": [k.config() for k in launch["kills"]],
                "max_restarts": len(launch["kills"]),
            }
            out = self.root / name
            proc = run(out, cfg, "lightning", timeout=LAUNCH_TIMEOUT)
            outcome = compare(out, reference, LAYOUTS[layout]["devices"])
            self.launched[name] = Launched(out, proc.stdout + proc.stderr, proc.returncode, outcome)
        return self.launched[name]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory.mktemp("recovery-faults"), tmp_path_factory.getbasetemp())


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _pid_around(out: Path, rank: int, moment: float) -> tuple[str, str]:
    """The process of ``rank`` whose ``fit`` started last before ``moment``, and the one that started first after."""
    starts = sorted((float(p.name.split(".", 2)[2]), p.read_text()) for p in out.glob(f"fit_start.rank{rank}.*"))
    before = [pid for t, pid in starts if t < moment]
    after = [pid for t, pid in starts if t > moment]
    return (before[-1] if before else ""), (after[0] if after else "")


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("launch_name,case", CASES)
def test_a_kill_is_recovered_in_place_exactly(launches, launch_name, case):
    """The killed rank is replaced (by a spare where the launch has one), every other rank keeps its process, the
    ranks resume from the snapshot every rank holds, no checkpoint file is read, and the run equals the reference."""
    launched, launch = launches.launch(launch_name), LAUNCHES[launch_name]
    kill: Kill = launch["kills"][case]
    out, output = launched.out, launched.output
    assert launched.returncode == 0, output[-6000:]
    assert launched.outcome.problems == [], output[-4000:]
    injected = [k for k in _jsonl(out / "injected.jsonl") if k["generation"] == kill.generation]
    completed = kill.step - 1 if kill.where == "step" else kill.step  # a step kill comes inside the step
    assert [(k["rank"], k["completed"]) for k in injected] == [(kill.rank, completed)], injected
    by = f"spare {case}" if launch["spares"] else "a new process"  # spare i+1 is started after spare i took a place
    generation = kill.generation + 1
    replaced = rf"rank {kill.rank} failed \(.*SIGKILL\); replacing it in place by {by} \(generation {generation}"
    assert re.search(replaced, output), output[-4000:]
    resumed = {r["generation"]: r["from_step"] for r in _jsonl(out / "resumed.rank0.jsonl")}
    assert resumed.get(kill.generation + 1) == kill.resumes_from, resumed
    for survivor in set(range(LAYOUTS[launch_name.split("-")[0]]["devices"])) - {kill.rank}:
        before, after = _pid_around(out, survivor, injected[0]["time"])
        assert before and before == after, (survivor, before, after)  # its `fit` ran again in its own process
    assert not list(out.glob("reads.rank*.txt")) and "resuming `fit` from '" not in output  # no checkpoint file read
    if kill.where == "write":
        interrupted = sorted(p for p in (out / "ckpt").iterdir() if f"step={kill.step}" in p.name)
        assert interrupted and all(not is_transient(p) and inspect_complete(p) for p in interrupted), interrupted
        saved = list((out / "ckpt").iterdir())
        assert all(not is_transient(p) and inspect_complete(p) is not None for p in saved), saved  # no leftover
