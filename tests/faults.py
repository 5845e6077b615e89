"""Run tests/scripts/fault.py under a launcher and measure how the run ends: when every process of it is gone after
the injected failure, the exit code, and who reported what. Used by tests/test_reliability.py and, repeated, by
tests/reliability_loop.py."""

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

from lightning_pipe.failures import pid_alive
from tests.launch import _PORT_CLASH, ROOT, SCRIPTS, clean_env, free_port

#: How long after the injected failure every process must be gone. The scripts' timeout is 300 s; the documented
#: bound is timeout + 30 s, and the run is expected to end long before the timeout matters.
BOUND = 60.0
#: Longest wait for the failure to be injected (start-up of 4 processes on 2 busy cores included).
START_LIMIT = 240.0


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
        c = self.cfg
        return f"{self.launcher}-{c['devices']}p-{c['phase']}-{c['action']}-rank{c['rank']}"

    def lines_of(self, rank: int) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith(f"[rank{rank}]:")]

    def reports_first_failure(self, rank: int, reporter: int) -> bool:
        """Whether ``reporter``'s output names ``rank`` as the rank that failed first."""
        pattern = re.compile(rf"Rank {rank}\b.* failed first")
        return any(pattern.search(line) for line in self.lines_of(reporter))


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
        pids: list[int] = []
        try:
            while True:
                time.sleep(0.2)
                now = time.time()
                if injected is None and (out / "injected.json").exists():
                    injected = _read_json(out / "injected.json")
                if launcher_exit is None and proc.poll() is not None:
                    launcher_exit = now
                pids = [int(p.read_text()) for p in out.glob("pid.rank*") if p.read_text().strip()]
                if launcher_exit is not None and not [p for p in pids if pid_alive(p)]:
                    all_gone = now
                    break
                t0 = injected["time"] if injected else None
                if (t0 is not None and now - t0 > BOUND) or (t0 is None and now - start > START_LIMIT):
                    break
        finally:
            lingering = [p for p in pids if pid_alive(p)]
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


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # being written; read again at the next poll


def scenario_dir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    return path
