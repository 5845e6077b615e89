"""Run tests/scripts/restart.py with a failure under a restarting launcher and compare it with the uninterrupted run:
used by tests/test_restart.py (a few scenarios, slow tier) and tests/restart_loop.py (the fault loop)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from tests.launch import SCRIPTS, clean_env, free_port, run_command

#: torchrun's restarts in the acceptance criteria; the same for Lightning's launcher (``max_restarts``).
MAX_RESTARTS = 3


def command(launcher: str, devices: int, port: str, out: Path, cfg: dict) -> list[str]:
    script = str(SCRIPTS / "restart.py")
    args = [str(out), json.dumps(cfg)]
    if launcher == "torchrun":
        run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={devices}", f"--master-port={port}"]
        return [*run, f"--max-restarts={MAX_RESTARTS}", script, *args]
    return [sys.executable, script, *args]


def run(out: Path, cfg: dict, launcher: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run one scenario in ``out`` (Lightning's launcher restarts through ``max_restarts``)."""
    out.mkdir(parents=True, exist_ok=True)
    if launcher == "lightning" and (cfg.get("kill") or cfg.get("kills")):
        cfg = {"max_restarts": MAX_RESTARTS, **cfg}
    port = str(free_port())
    env = clean_env(MASTER_PORT=port)
    start = time.time()
    proc = run_command(command(launcher, cfg["devices"], port, out, cfg), env, timeout)
    (out / "wall.json").write_text(json.dumps({"start": start, "end": time.time()}))
    (out / "output.log").write_text(proc.stdout + proc.stderr)
    return proc


def losses(out: Path, rank: int) -> list[dict[str, Any]]:
    file = out / f"losses.rank{rank}.jsonl"
    return [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []


def validations(out: Path, rank: int) -> list[dict[str, Any]]:
    """The validation losses a run logged (``{"generation", "step", "val_loss"}``), in order."""
    file = out / f"val.rank{rank}.jsonl"
    return [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []


@dataclass
class Outcome:
    """How a faulted run compares with the uninterrupted one, and what it cost."""

    attempts: int
    #: training steps completed when the rank was killed
    completed: Optional[int]
    resumed_from: Optional[int]
    #: seconds from the SIGKILL to the end of the first step after the resume
    failure_to_first_step: Optional[float]
    problems: list[str]

    @property
    def recomputed(self) -> Optional[int]:
        """Steps trained twice: completed before the failure, and again after the resume."""
        if self.completed is None or self.resumed_from is None:
            return None
        return self.completed - self.resumed_from


def compare(out: Path, reference: Path, devices: int, faulted: bool = True) -> Outcome:
    """Every step a faulted run trained (before the failure and after the resume) has the reference's loss, bit for
    bit, and its final weights are the reference's."""
    problems: list[str] = []
    injected = _json(out / "injected.json")
    if faulted and injected is None:
        problems.append("the failure was never injected")
    resumed = _json(out / "resumed.rank0.json")
    attempts = 1 + max((int(p.name.rsplit("attempt", 1)[1]) for p in out.glob("pid.rank0.attempt*")), default=0)
    for rank in range(devices):
        expected = {r["step"]: r["loss"] for r in losses(reference, rank)}
        seen = losses(out, rank)
        if not seen:
            problems.append(f"rank {rank} recorded no step")
        for record in seen:
            if expected.get(record["step"]) != record["loss"]:
                problems.append(
                    f"rank {rank} step {record['step']} (attempt {record['attempt']}): loss"
                    f" {float.fromhex(record['loss'])!r} != {_loss(expected.get(record['step']))!r}"
                )
        problems += _validation_problems(out, reference, rank)
        if max((r["step"] for r in seen), default=0) != max(expected, default=0):
            problems.append(f"rank {rank} did not train to the end")
        final, ref = out / f"final.rank{rank}.pt", reference / f"final.rank{rank}.pt"
        if not final.exists():
            problems.append(f"rank {rank} left no final weights")
            continue
        got, want = torch.load(final), torch.load(ref)
        differ = [k for k in want if k not in got or not torch.equal(got[k], want[k])]
        if differ or set(got) != set(want):
            problems.append(f"rank {rank} final weights differ: {differ[:4]}")
    first_step = None
    if injected and resumed:
        first_step = resumed["first_step_end"] - injected["time"]
    if injected and not resumed:
        problems.append("the run was never resumed")
    return Outcome(
        attempts=attempts,
        completed=injected["completed"] if injected else None,
        resumed_from=resumed["from_step"] if resumed else None,
        failure_to_first_step=first_step,
        problems=problems,
    )


def _validation_problems(out: Path, reference: Path, rank: int) -> list[str]:
    expected = {r["step"]: r["val_loss"] for r in validations(reference, rank)}
    return [
        f"rank {rank} validation after step {r['step']}: val_loss {_loss(r['val_loss'])!r} !="
        f" {_loss(expected.get(r['step']))!r}"
        for r in validations(out, rank)
        if expected.get(r["step"]) != r["val_loss"]
    ]


def _loss(text: Optional[str]) -> Optional[float]:
    return None if text is None else float.fromhex(text)


def _json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def reference(root: Path, devices: int) -> Path:
    """The uninterrupted run of ``devices`` processes (made once under ``root``)."""
    out = root / f"reference-{devices}p"
    if not (out / "final.rank0.pt").exists():
        proc = run(out, {"devices": devices}, "lightning")
        if proc.returncode != 0:
            raise RuntimeError(f"the reference run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return out


def uninterrupted(root: Path, devices: int, timeout: float = 600) -> Path:
    """The run of ``devices`` processes without a fault, snapshots or checkpoint files, made once under ``root``: the
    test modules that compare with it pass the session's base temporary directory and share it."""
    out = root / f"uninterrupted-{devices}p"
    if not (out / "complete").exists():
        shutil.rmtree(out, ignore_errors=True)  # a run that failed before: made again, from nothing
        proc = run(out, {"devices": devices, "disk": False}, "lightning", timeout=timeout)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        (out / "complete").touch()
    return out
