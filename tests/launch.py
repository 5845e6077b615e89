"""Run a multi-process scenario as its own script, so Lightning's launcher re-runs that script (not pytest)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
# First on a launched process's PYTHONPATH: its exit skips the final garbage collection (tests/site/sitecustomize.py).
SITE = Path(__file__).resolve().parent / "site"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Set in the pytest process by any in-process Lightning run; a child must not inherit them.
_DIST_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "LIGHTNING_PIPE_LAUNCHER_PID",
    "LIGHTNING_PIPE_LAUNCHER_RANK",
)
# One intra-op thread in every launched process: float results then depend on the op sequence, not on the machine's
# core count (Lightning's launcher would otherwise give rank 0 cpu_count // devices threads and the others all cores).
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without distributed settings, with the repository on PYTHONPATH and one thread."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS and not k.startswith("TORCHELASTIC_")}
    return {**env, **THREADS, "PYTHONPATH": f"{SITE}{os.pathsep}{ROOT}", "PYTHONUNBUFFERED": "1", **extra}


_PORT_CLASH = (
    "EADDRINUSE",
    "address already in use",
    "Address already in use",
    "failed to listen on any local network address",  # the c10d store could not bind its port
)


def run_command(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session and kill the whole session when it ends.

    Lightning's launcher starts ranks 1..N-1 as children of rank 0; if rank 0 dies they are orphaned and would wait
    for it until the process-group timeout while holding our output pipes. Output goes to files, not pipes, and the
    session is killed as soon as the command returns (or times out), so a failed launch fails the test at once.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = -signal.SIGKILL
            err.write(f"\n[tests.launch] killed after {timeout} s\n")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, returncode, out.read(), err.read())


def launch(cmd_for_port, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run the command ``cmd_for_port(port)`` builds; once more on a new port if the first one was taken meanwhile
    (a port found free can be bound by another process before rank 0 listens on it)."""
    for attempt in range(2):
        port = str(free_port())
        proc = run_command(cmd_for_port(port), {**env, "MASTER_PORT": port}, timeout)
        if proc.returncode == 0 or not any(s in proc.stdout + proc.stderr for s in _PORT_CLASH) or attempt:
            return proc
    return proc


class Launch:
    """A launch whose scenarios each left an outcome (tests/scripts/outcomes.py): ``<name>.rank<r>.pt`` or the
    scenario's traceback in ``<name>.rank<r>.failed``. A module fixture makes it once; each test reads its scenario's
    ranks, so a failing scenario (or a launch that ended early) fails its own tests and no other."""

    def __init__(self, out: Path, nprocs: int, proc: subprocess.CompletedProcess) -> None:
        self.out, self.nprocs, self.proc = out, nprocs, proc

    def ranks(self, name: str) -> list[dict]:
        """Every rank's result of scenario ``name``; fails the test with the scenario's own traceback, or with the
        launch's output when the scenario left no result on some rank."""
        import torch

        failed = sorted(self.out.glob(f"{name}.rank*.failed"))
        if failed:
            tracebacks = "\n".join(f"--- {path.name}\n{path.read_text()}" for path in failed)
            pytest.fail(f"scenario {name} failed:\n{tracebacks}", pytrace=False)
        paths = [self.out / f"{name}.rank{r}.pt" for r in range(self.nprocs)]
        missing = [path.name for path in paths if not path.is_file()]
        if missing:
            pytest.fail(
                f"scenario {name} left no result in {missing}: the launch exited {self.proc.returncode}"
                f"\n--- stdout\n{self.proc.stdout[-4000:]}\n--- stderr\n{self.proc.stderr[-12000:]}",
                pytrace=False,
            )
        return [torch.load(path, weights_only=False) for path in paths]


def run_scenarios(name: str, out: Path, configs: list[dict], nprocs: int, **kwargs: Any) -> Launch:
    """Launch ``tests/scripts/<name>`` on ``configs`` (its arguments: ``out`` and the configs as JSON); a failed launch
    fails no test here, only the tests of the scenarios it left without outcome (:meth:`Launch.ranks`)."""
    proc = run_script(name, str(out), json.dumps(configs), nprocs=nprocs, check=False, **kwargs)
    return Launch(out, nprocs, proc)


def run_script(
    name: str,
    *args: str,
    nprocs: int = 1,
    launcher: str = "lightning",
    timeout: float = 600,
    env: dict[str, str] | None = None,
    expect_failure: bool = False,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``tests/scripts/<name>`` with ``launcher`` ("lightning": plain python, Lightning starts the other ranks;
    "torchrun": ``torch.distributed.run`` starts ``nprocs`` ranks). Fails the test with the output tail on error
    (unless ``check`` is false: then the caller reads the exit status)."""
    script = str(SCRIPTS / name)
    full_env = clean_env(**(env or {}))

    def command(port: str) -> list[str]:
        if launcher == "torchrun":
            run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}", f"--master-port={port}"]
            return [*run, script, *args]
        return [sys.executable, script, *args]

    proc = launch(command, full_env, timeout)
    if expect_failure:
        if proc.returncode == 0:
            pytest.fail(f"{name} {args} was expected to fail but succeeded:\n{proc.stdout[-3000:]}")
    elif check and proc.returncode != 0:
        pytest.fail(
            f"{name} {args} exited {proc.returncode}:\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n"
            f"{proc.stderr[-12000:]}"
        )
    return proc


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def agreed_errors(out: Path, nprocs: int = 2) -> dict[str, str]:
    """The error message of each scenario whose ranks saved ``error-<name>.rank<r>.pt``; fails if ranks disagree."""
    import torch

    errors = {}
    for path in out.glob("error-*.rank0.pt"):
        name = path.name[len("error-") : -len(".rank0.pt")]
        messages = {torch.load(out / f"error-{name}.rank{r}.pt")["error"] for r in range(nprocs)}
        assert len(messages) == 1, f"ranks disagree on {name}: {messages}"
        errors[name] = messages.pop()
    return errors


#: A shared launch part's scenarios, or what makes them at launch; what writes a part's inputs into its folder.
Configs = list[dict] | Callable[[Path], list[dict]]
Prepare = Callable[[Path], None]


class Shared:
    """One launch of ``nprocs`` processes that runs the scenarios of several test modules (tests/scripts/together.py):
    each 4-process launch starts 4 interpreters that import torch, Lightning and the scripts (about 30 s of CPU, 15 s
    on 2 cores) before its first scenario, so modules whose launches need nothing from each other share one.

    A module declares its part at import (:meth:`part`); the first of its fixtures to run (:meth:`launch`) starts the
    parts of every module that has a selected test using that part's fixture, in the order the modules were imported,
    each in a folder of its own that the part's ``prepare`` (if any) first fills with its inputs (model directories).
    A part's scenarios and its outcomes are those of its script run alone; a failure that takes the processes down
    leaves the later parts without outcome, and their tests report the launch's output."""

    def __init__(self, nprocs: int, launcher: str = "torchrun") -> None:
        self.nprocs, self.launcher = nprocs, launcher
        self.parts: dict[tuple[str, str], tuple[str, Configs, float, Prepare | None]] = {}
        self.launches: dict[tuple[str, str], Launch] = {}
        self.session: object = None

    def part(
        self,
        module: str,
        fixture: str,
        script: str,
        configs: Configs,
        timeout: float = 600,
        prepare: Prepare | None = None,
    ) -> None:
        """Module ``module``'s fixture ``fixture`` reads the outcomes of ``script`` run on ``configs`` (a callable: made
        at launch from the part's folder, when they name files in it or depend on installed versions that module
        imports should not load); ``prepare(out)`` first writes the inputs the scenarios read into that folder."""
        self.parts[(module, fixture)] = (script, configs, timeout, prepare)

    def launch(self, request: pytest.FixtureRequest) -> Launch:
        """The outcomes of the part of the module-scoped fixture making this request."""
        key = (request.module.__name__, request.fixturename)
        if request.session is not self.session:  # a new session (a pytester run) launches anew
            self.session, self.launches = request.session, {}
        if key not in self.launches:
            self._run(request, key)
        return self.launches[key]

    def needed(self, key: tuple[str, str], items: list[pytest.Item]) -> list[tuple[str, str]]:
        """The parts not yet launched that ``key`` and the tests ``items`` (the session's selection) read, in the
        order of the modules' import."""
        needed = {key}
        for item in items:
            module = getattr(getattr(item, "module", None), "__name__", None)
            needed |= {(m, f) for (m, f) in self.parts if m == module and f in getattr(item, "fixturenames", ())}
        return [k for k in self.parts if k in needed and k not in self.launches]

    def _run(self, request: pytest.FixtureRequest, key: tuple[str, str]) -> None:
        keys = self.needed(key, request.session.items)
        factory = request.getfixturevalue("tmp_path_factory")
        outs = {k: factory.mktemp(f"{k[0].rsplit('.', 1)[-1]}-{k[1]}") for k in keys}
        spec = []
        for k in keys:
            script, configs, _, prepare = self.parts[k]
            if prepare is not None:
                prepare(outs[k])
            spec.append(
                {"script": script, "out": str(outs[k]), "configs": configs(outs[k]) if callable(configs) else configs}
            )
        timeout = sum(self.parts[k][2] for k in keys)
        proc = run_script(
            "together.py", json.dumps(spec), nprocs=self.nprocs, launcher=self.launcher, timeout=timeout, check=False
        )
        self.launches.update({k: Launch(outs[k], self.nprocs, proc) for k in keys})


#: The 4-process torchrun launch that test modules with no order between launches share.
SHARED_FOUR = Shared(4)
#: The same for 2-process scenarios, started by Lightning's launcher.
SHARED_TWO = Shared(2, "lightning")
