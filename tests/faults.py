"""Run tests/scripts/fault.py under a launcher and measure how the run ends: when every process of it is gone after
the injected failure, the exit code, who reported what, and whether the last checkpoint is complete. Used by
tests/test_reliability.py (the CI matrix) and tests/reliability_loop.py (the full matrix, repeated)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from lightning_pipe.checkpoint.convert import inspect
from lightning_pipe.errors import PipelineCheckpointError
from lightning_pipe.reliability.board import pid_alive
from tests.launch import _PORT_CLASH, ROOT, SCRIPTS, clean_env, free_port

#: How long after the injected failure every process must be gone. The scripts' timeout is 300 s; the documented
#: bound is timeout + 30 s, and the run is expected to end long before the timeout matters.
BOUND = 60.0
#: Longest wait for the failure to be injected (start-up of 4 processes on 2 busy cores included).
START_LIMIT = 240.0
PHASES = ("startup", "pg", "step", "validation", "save", "teardown")
ACTIONS = ("kill", "raise")
LAUNCHERS = ("lightning", "torchrun")
#: Phases after which fault.py has written a complete ``last.ckpt`` (at step 2) before the failure.
CHECKPOINTED = ("step", "validation", "save", "teardown")
_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):\s*\[\d+\]:\s*time\s*:[^\n]*\n\s*host\s*:[^\n]*\n\s*rank\s*:\s*(\d+)"
)


def scenario(launcher: str, devices: int, phase: str, action: str, rank: int) -> tuple[str, dict]:
    return launcher, {"devices": devices, "phase": phase, "action": action, "rank": rank}


def scenario_id(launcher: str, cfg: dict) -> str:
    return f"{launcher}-{cfg['devices']}p-{cfg['phase']}-{cfg['action']}-rank{cfg['rank']}"


def full_matrix() -> list[tuple[str, dict]]:
    """Every launcher x phase x action x failing rank, for 2 and 4 processes (144 runs)."""
    return [
        scenario(launcher, devices, phase, action, rank)
        for devices in (2, 4)
        for launcher in LAUNCHERS
        for phase in PHASES
        for action in ACTIONS
        for rank in range(devices)
    ]


def ci_matrix() -> list[tuple[str, dict]]:
    """A covering subset (20 runs): with 2 processes, every phase fails once by SIGKILL and once by exception, on
    both ranks and under both launchers (and across phases every launcher x rank x action); with 4 processes, every
    phase, every rank (the middle ones, with two neighbours, in the steps), both actions and launchers."""
    two = [
        scenario(LAUNCHERS[(i + a) % 2], 2, phase, action, ((i // 2) + a) % 2)
        for i, phase in enumerate(PHASES)
        for a, action in enumerate(ACTIONS)
    ]
    four = [
        scenario("lightning", 4, "startup", "kill", 3),
        scenario("torchrun", 4, "pg", "raise", 2),
        scenario("torchrun", 4, "step", "kill", 1),
        scenario("lightning", 4, "step", "raise", 2),
        scenario("lightning", 4, "validation", "kill", 0),
        scenario("torchrun", 4, "validation", "raise", 3),
        scenario("torchrun", 4, "save", "kill", 2),
        scenario("lightning", 4, "teardown", "raise", 1),
    ]
    return two + four


@dataclass
class FaultRun:
    cfg: dict
    launcher: str
    returncode: int | None
    output: str
    injected: dict | None
    #: seconds from the injected failure until every process of the run was gone (None: not all gone in BOUND)
    all_gone_after: float | None
    #: seconds from the injected failure until the launching process (rank 0, or torchrun's agent) exited
    launcher_exit_after: float | None
    lingering: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return scenario_id(self.launcher, self.cfg)

    def lines_of(self, rank: int) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith(f"[rank{rank}]:")]

    def reports_first_failure(self, rank: int, reporter: int) -> bool:
        """Whether ``reporter``'s output names ``rank`` as the rank that failed first."""
        pattern = re.compile(rf"Rank {rank}\b.* failed first")
        return any(pattern.search(line) for line in self.lines_of(reporter))

    def reported_by_survivor(self, rank: int) -> bool:
        return any(self.reports_first_failure(rank, r) for r in range(self.cfg["devices"]) if r != rank)

    def agent_root_cause(self) -> int | None:
        """The rank torchrun's agent names as the root cause of the failure."""
        found = _ROOT_CAUSE.search(self.output)
        return int(found.group(1)) if found else None

    def problems(self, out: Path) -> list[str]:
        """Everything this run did wrong; empty when it ended as documented in docs/reliability.md."""
        cfg, rank = self.cfg, self.cfg["rank"]
        if self.injected is None:
            return ["the failure was never injected"]
        problems = []
        if self.all_gone_after is None or self.lingering:
            problems.append(f"processes {self.lingering} still ran {BOUND:.0f} s after the failure (a hang)")
        if self.returncode in (0, None):
            problems.append(f"the launching process exited with {self.returncode}")
        if not self._reported():
            problems.append(f"no report names rank {rank} as the first failure")
        if cfg["phase"] in CHECKPOINTED:
            try:
                inspect(out / "ckpt" / "last.ckpt")
            except (PipelineCheckpointError, OSError) as err:
                problems.append(f"the last checkpoint is not complete: {err}")
        return problems

    def _reported(self) -> bool:
        """Rank 0 reports the rank that failed first; a failing rank 0 reports itself (its exception), or, killed,
        the others do (they lose their launcher under Lightning's). Under torchrun the agent, the launching process,
        names the root cause too (a worker it ends with SIGTERM may not get to print)."""
        rank = self.cfg["rank"]
        if self.launcher == "torchrun" and self.agent_root_cause() == rank:
            return True
        if rank != 0:
            return self.reports_first_failure(rank, 0)
        if self.cfg["action"] == "raise":
            return f"injected failure on rank 0 ({self.cfg['phase']})" in self.output
        return (
            self.reported_by_survivor(0) or "rank 0 (pid" in self.output and "which launched this rank" in self.output
        )


def _command(launcher: str, devices: int, port: str, args: list[str]) -> list[str]:
    script = str(SCRIPTS / "fault.py")
    if launcher == "torchrun":
        run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={devices}", f"--master-port={port}"]
        return [*run, script, *args]
    return [sys.executable, script, *args]


def run_fault(out: Path, cfg: dict, launcher: str) -> FaultRun:
    """Launch one fault scenario in ``out`` and watch it end; the run's session is killed afterwards in any case."""
    for attempt in range(2):
        run = _run_once(out, cfg, launcher)
        if run.injected is not None or not any(s in run.output for s in _PORT_CLASH) or attempt:
            return run
        for stale in out.iterdir():
            if stale.is_file():
                stale.unlink()
    return run


def _run_once(out: Path, cfg: dict, launcher: str) -> FaultRun:
    port = str(free_port())
    env = {**clean_env(), "MASTER_PORT": port}
    cmd = _command(launcher, cfg["devices"], port, [str(out), json.dumps(cfg)])
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        start = time.time()
        injected = None
        launcher_exit = all_gone = None
        pids: set[int] = {proc.pid}  # every process of the run seen so far: descendants, and ranks by their pid files
        try:
            while True:
                time.sleep(0.2)
                now = time.time()
                if injected is None and (out / "injected.json").exists():
                    injected = _read_json(out / "injected.json")
                if launcher_exit is None and proc.poll() is not None:
                    launcher_exit = now
                pids |= _descendants(proc.pid) | {int(p.read_text()) for p in out.glob("pid.rank*") if p.read_text()}
                if launcher_exit is not None and not [p for p in pids if pid_alive(p)]:
                    all_gone = now
                    break
                t0 = injected["time"] if injected else None
                if (t0 is not None and now - t0 > BOUND) or (t0 is None and now - start > START_LIMIT):
                    break
        finally:
            lingering = sorted(p for p in pids if p != proc.pid and pid_alive(p))
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for pid in lingering:  # a rank that left the session (none should)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        log.seek(0)
        output = log.read()
    t0 = injected["time"] if injected else None
    return FaultRun(
        cfg=cfg,
        launcher=launcher,
        returncode=proc.returncode if launcher_exit is not None else None,
        output=output,
        injected=injected,
        all_gone_after=None if all_gone is None or t0 is None else max(0.0, all_gone - t0),
        launcher_exit_after=None if launcher_exit is None or t0 is None else max(0.0, launcher_exit - t0),
        lingering=lingering,
    )


def _descendants(root: int) -> set[int]:
    """The processes below ``root``, or in its session, now (orphans stay in the session: Lightning's ranks; the
    caller keeps tracking a rank seen once)."""
    children: dict[int, list[int]] = {}
    session = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        pid = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(pid)
        if int(fields[3]) == root and pid != root:
            session.add(pid)
    found, todo = session, [root, *session]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # being written; read again at the next poll


def scenario_dir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    return path
