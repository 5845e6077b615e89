"""Run a multi-process scenario as its own script, so Lightning's launcher re-runs that script (not pytest)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(
    name: str,
    *args: str,
    nprocs: int = 1,
    launcher: str = "lightning",
    timeout: float = 600,
    env: dict[str, str] | None = None,
    expect_failure: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``tests/scripts/<name>`` with ``launcher`` ("lightning": plain python, Lightning starts the other ranks;
    "torchrun": ``torch.distributed.run`` starts ``nprocs`` ranks). Fails the test with the output tail on error."""
    script = str(SCRIPTS / name)
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("LOCAL_RANK", None)
    if launcher == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nprocs}",
            f"--master-port={free_port()}",
            script,
            *args,
        ]
    else:
        full_env.setdefault("MASTER_PORT", str(free_port()))
        cmd = [sys.executable, script, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if expect_failure:
        if proc.returncode == 0:
            pytest.fail(f"{name} {args} was expected to fail but succeeded:\n{proc.stdout[-3000:]}")
    elif proc.returncode != 0:
        pytest.fail(
            f"{name} {args} exited {proc.returncode}:\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n"
            f"{proc.stderr[-8000:]}"
        )
    return proc


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())
