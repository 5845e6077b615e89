"""Failures end the run and are reported: the failure board and its reports (one process, a real TCPStore), the
watchdog's parent and child watches (small real processes), and the fault matrix (real pipelines under both
launchers, a rank killed or raising in each phase; see docs/reliability.md)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist

import lightning_pipe
from lightning_pipe import PipelinePeerFailure
from lightning_pipe.reliability import failures, watchdog
from lightning_pipe.reliability.board import Board, Failure, describe_exit, pid_alive
from tests.faults import ACTIONS, LAUNCHERS, ci_matrix, run_fault, scenario_id
from tests.launch import clean_env, free_port, run_script
from tests.models import LitLM, quiet_trainer

# ---------------------------------------------------------------------------------------------------- reports (pure)


def test_failure_sentence_names_rank_stages_phase_and_error():
    f = Failure(1, (1,), "during training", "ValueError: boom", "tb", pid=7, host="h")
    assert f.sentence() == "Rank 1 (pipeline stage 1) failed first, during training: ValueError: boom"
    assert Failure(2, (1, 3), "", "x").where == "rank 2 (pipeline stages 1 and 3)"
    assert Failure(0, (), "during start-up", "x").sentence() == "Rank 0 failed first, during start-up: x"
    assert Failure.from_json(f.to_json()) == f


def test_exit_descriptions():
    assert "was killed by SIGKILL" in describe_exit(12, -signal.SIGKILL)
    assert "exited with code 3" in describe_exit(12, 3)
    assert describe_exit(12, None).startswith("its process (pid 12) ended without reporting")


def test_broken_connections_are_told_from_failures():
    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:9644."
    assert failures.is_broken_connection(RuntimeError(gloo))
    assert failures.is_broken_connection(dist.DistNetworkError("Failed to recv, got 0 bytes."))
    assert failures.is_broken_connection(RuntimeError("Timed out waiting 60000ms for recv operation to complete"))
    assert not failures.is_broken_connection(ValueError("Connection closed by peer"))
    assert not failures.is_broken_connection(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert failures._first_sentence(RuntimeError(gloo)) == "RuntimeError: Connection closed by peer [127.0.0.1]:9644"


def test_pid_alive_takes_a_zombie_for_dead():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while pid_alive(child.pid) and time.monotonic() < deadline:  # exited, not reaped: a zombie
        time.sleep(0.05)
    assert not pid_alive(child.pid)
    child.wait()
    assert pid_alive(os.getpid())


def test_phase_names_the_innermost_phase_of_an_exception():
    @failures.in_phase("while saving a checkpoint")
    def save():
        with failures.phase("inner"):
            raise ValueError("x")

    with pytest.raises(ValueError) as caught:
        with failures.phase("during teardown"):
            save()
    assert caught.value._lightning_pipe_phase == "inner"
    assert failures.current_phase() == "during start-up"  # no trainer, no phase


def test_pipelining_wrapper_is_unwrapped():
    cause = ValueError("the real error")
    code = compile("raise RuntimeError('[Stage 1] failed to run forward') from cause", "/t/pipelining/s.py", "exec")
    try:
        exec(code, {"cause": cause})
    except RuntimeError as err:
        assert failures._root_error(err) is cause
    plain = RuntimeError("mine")
    plain.__cause__ = cause
    assert failures._root_error(plain) is plain  # raised elsewhere: the outer error is the user's message


# ---------------------------------------------------------------------------------------------------- the board


@pytest.fixture
def store(monkeypatch):
    """A rendezvous store in this process, as rank 0 of a 2-process run holds it; a fresh process state."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(failures.LAUNCHER_PID, raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setattr(failures, "_PROCESS", failures._Process(rank=0, world_size=2))
    monkeypatch.setattr(failures, "REPORT_WAIT", 0.5)
    holder = {"server": server}
    del server
    yield holder


def test_board_keeps_the_first_record_and_the_registrations(store):
    board = Board.connect(2)
    assert board is not None and board.first(1) is None
    first = Failure(1, (1,), "during training", "ValueError: a")
    assert board.record(1, first) == first
    assert board.record(1, Failure(0, (0,), "", "later")) == first
    assert board.first(2) is None  # the next Trainer entry starts clean
    board.register(1, [1, 3])
    assert board.registered()[1]["stages"] == [1, 3] and board.registered()[1]["pid"] == os.getpid()
    assert board.reachable()


def test_entry_records_own_failure_and_raises_a_peers_instead_of_a_broken_connection(store):
    failures.describe(0, [0])
    with pytest.raises(ValueError, match="mine"):
        with failures.entry():
            raise ValueError("mine")
    own = "Rank 0 (pipeline stage 0) failed first, during start-up: ValueError: mine"
    assert failures.first_failure().sentence() == own

    peer = Failure(1, (1,), "during validation", "InjectedFailure: boom", "Traceback ...\nInjectedFailure: boom")
    Board.connect(2).record(failures.entry_index() + 1, peer)
    with pytest.raises(PipelinePeerFailure) as caught:
        with failures.entry():
            raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1. GLHF")
    message = str(caught.value)
    assert message.startswith("Rank 1 (pipeline stage 1) failed first, during validation: InjectedFailure: boom.")
    assert "saw only the consequence (RuntimeError: Connection closed by peer [127.0.0.1]:1)" in message
    assert caught.value.__notes__ == ["--- rank 1's traceback ---\nTraceback ...\nInjectedFailure: boom"]
    assert caught.value.__suppress_context__  # the socket error is not printed above the report


def test_a_checkpoint_exception_is_the_failing_ranks_own_error_and_a_peers_failure_elsewhere(store):
    from torch.distributed.checkpoint.api import CheckpointException

    failures.describe(0, [0])
    failed_here = CheckpointException("save failed", {0: (OSError("disk full"), traceback.StackSummary())})
    with pytest.raises(CheckpointException):
        with failures.entry():
            raise failed_here
    assert failures.first_failure().error == "OSError: disk full"

    Board.connect(2).record(failures.entry_index() + 1, Failure(1, (1,), "while saving a checkpoint", "E: x"))
    with pytest.raises(
        PipelinePeerFailure,
        match=r"Rank 1 \(pipeline stage 1\) failed first.*saving a checkpoint.*save failed on rank\(s\) \[1\]",
    ):
        with failures.entry():
            raise CheckpointException("save failed", {1: (OSError("x"), traceback.StackSummary())})


def test_a_dead_peer_without_a_record_is_named_by_its_pid(store):
    failures.describe(0, [0])
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    board = Board.connect(2)
    board.store.set(
        f"{board.prefix}/rank1", json.dumps({"pid": child.pid, "host": socket.gethostname(), "stages": [1]})
    )
    dead = rf"Rank 1 \(pipeline stage 1\) failed first: its process \(pid {child.pid}\) ended"
    with pytest.raises(PipelinePeerFailure, match=dead):
        with failures.entry():
            raise RuntimeError("Connection reset by peer")


def test_a_store_that_is_gone_is_reported(store):
    failures.describe(0, [0])
    failures.board()
    del store["server"]  # the process hosting the store ended
    with pytest.raises(PipelinePeerFailure, match="rendezvous store at 127.0.0.1:.* is gone too"):
        with failures.entry():
            raise RuntimeError("Connection closed by peer")


def test_a_broken_connection_without_any_news_stays_as_it_is(store):
    failures.describe(0, [0])
    with pytest.raises(RuntimeError, match="Timed out waiting"):
        with failures.entry():
            raise RuntimeError("Timed out waiting 1000ms for recv operation to complete")


# ------------------------------------------------------------------------------------------------- watchdog (processes)


def test_which_launcher_a_rank_must_not_outlive(monkeypatch):
    from lightning_pipe.reliability import watchdog

    for key in ("TORCHELASTIC_RUN_ID", failures.LAUNCHER_PID, "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert watchdog._expected_parent() is None  # started by hand: rank 0, or a single process
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert watchdog._expected_parent() == os.getppid()  # torchrun's agent
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv(failures.LAUNCHER_PID, str(os.getppid()))
    assert watchdog._expected_parent() == os.getppid()  # Lightning's launcher
    monkeypatch.setenv(failures.LAUNCHER_PID, str(os.getpid()))
    assert watchdog._expected_parent() is None  # the launcher itself
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setenv(failures.LAUNCHER_PID, str(gone.pid))
    assert watchdog._expected_parent() == gone.pid  # orphaned before the watch started: it exits at once
    if os.getppid() != 1:
        monkeypatch.setenv(failures.LAUNCHER_PID, "1")
        assert watchdog._expected_parent() is None  # inherited from an unrelated, living ancestor


_ORPHAN = """
import os, signal, subprocess, sys
code = "from lightning_pipe.reliability import watchdog; import time; watchdog.start(); time.sleep(120)"
env = {**os.environ, "LIGHTNING_PIPE_LAUNCHER_PID": str(os.getpid()), "LOCAL_RANK": "1"}
child = subprocess.Popen([sys.executable, "-c", code], env=env)
print(child.pid, flush=True)
import time; time.sleep(float(sys.argv[1]))
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_rank_whose_launcher_died_exits_on_its_own(tmp_path):
    """Lightning's launcher (rank 0) SIGKILLed: the rank it started exits within a second or two, with a message."""
    err = tmp_path / "err.txt"
    with open(err, "w") as f:
        cmd = [sys.executable, "-c", _ORPHAN, "8"]
        launcher = subprocess.run(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=f, text=True, timeout=120)
    child = int(launcher.stdout.split()[0])
    died = time.monotonic()
    while pid_alive(child) and time.monotonic() - died < 30:
        time.sleep(0.1)
    assert not pid_alive(child), "the orphaned rank kept running"
    assert time.monotonic() - died < 5
    assert "lightning-pipe: rank 0 (pid" in err.read_text() and "which launched this rank, ended" in err.read_text()


_JOIN = """
import subprocess, sys
from datetime import timedelta
from lightning_pipe.reliability import watchdog
child = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
watchdog.watch_children([child], first_rank=1, timeout=timedelta(seconds=30))
print("rank 0 done", flush=True)
"""


@pytest.mark.slow
def test_rank0_waits_for_its_ranks_and_fails_when_one_failed():
    """At the end of rank 0's script, a rank that exited with an error makes the whole run exit non-zero."""
    proc = subprocess.run([sys.executable, "-c", _JOIN], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "rank 0 done" in proc.stdout
    assert "Rank 1 failed first: its process (pid" in proc.stderr and "exited with code 3" in proc.stderr


_EXIT = """
import atexit, sys
import torch.distributed as dist
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))  # runs after the strategy's
import lightning_pipe
lightning_pipe.PipelineParallelStrategy()
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
dist.barrier()
if sys.argv[2] == "fail":
    raise RuntimeError("the user's error")
"""


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["clean", "fail"])
def test_the_process_group_is_destroyed_at_a_clean_exit_only(tmp_path, ending):
    """A clean exit destroys the group before the interpreter's finalisation (gloo's threads would abort it); after an
    uncaught exception the group is left for the failure report."""
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT, str(tmp_path / "store"), ending],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == (0 if ending == "clean" else 1), proc.stderr
    assert f"initialized at exit: {ending == 'fail'}" in proc.stdout


# ---------------------------------------------------------------------------------------------------- fault matrix

_MATRIX = ci_matrix()


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize(("launcher", "cfg"), _MATRIX, ids=[scenario_id(launcher, cfg) for launcher, cfg in _MATRIX])
def test_fault_ends_every_process_and_is_reported(tmp_path, launcher, cfg):
    """Every process is gone soon after the failure (the bound: timeout + 30 s; the scripts' timeout is 300 s and
    the run must not need it), the launching process exits non-zero, rank 0 (or, for its own failure, the others)
    reports the rank that failed first, and the last complete checkpoint stays complete; after a kill in the middle
    of a save, the run resumes from it."""
    run = run_fault(tmp_path, cfg, launcher)
    assert not run.problems(tmp_path), f"{run.name}: {run.problems(tmp_path)}\n{run.output[-6000:]}"
    if cfg["phase"] == "save" and cfg["action"] == "kill":
        for stale in tmp_path.glob("pid.rank*"):
            stale.unlink()
        resume = json.dumps({"resume": True, "devices": cfg["devices"]})
        run_script("fault.py", str(tmp_path), resume, nprocs=cfg["devices"], launcher=launcher, timeout=300)
        done = torch.load(tmp_path / "done.rank0", weights_only=False)
        assert done["global_step"] == 8 and len(done["losses"]) == 6  # resumed at step 2, trained steps 3..8
        assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["last.ckpt"]  # the interrupted save's leftovers


def test_ci_matrix_covers_every_phase_action_launcher_and_rank():
    two = [(launcher, c) for launcher, c in _MATRIX if c["devices"] == 2]
    four = [(launcher, c) for launcher, c in _MATRIX if c["devices"] == 4]
    phases = {c["phase"] for _, c in _MATRIX}
    for phase in phases:
        pairs = {(c["action"], c["rank"]) for _, c in two if c["phase"] == phase}
        assert pairs in ({("kill", 0), ("raise", 1)}, {("kill", 1), ("raise", 0)})
        assert {launcher for launcher, c in two if c["phase"] == phase} == {"lightning", "torchrun"}
    combos = {(launcher, action, rank) for launcher in LAUNCHERS for action in ACTIONS for rank in (0, 1)}
    assert {(launcher, c["action"], c["rank"]) for launcher, c in two} == combos
    assert {c["phase"] for _, c in four} == phases and {c["rank"] for _, c in four} == {0, 1, 2, 3}


# ---------------------------------------------------------------------------------------------------- nesting, blame


def test_a_ranks_own_communication_error_is_reported_as_its_own(store):
    """An error a rank's own collective raises (it names NCCL or gloo, but no peer is gone) is that rank's failure:
    recorded for the others and raised as it is, even when a peer's failure happens to be on the board."""
    own = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1234, invalid usage, NCCL version 2.21.5")
    size = RuntimeError("[enforce fail at gloo/allreduce.cc:40] inputs.size() == outputs.size(). 2 vs 1")
    assert not failures.is_broken_connection(own) and not failures.is_broken_connection(size)
    assert not failures.is_broken_connection(RuntimeError("DataLoader worker (pid 12) timed out after 5 seconds"))
    assert failures.is_broken_connection(RuntimeError("NCCL communicator was aborted on rank 1."))
    # Rank 0 hosting the store could not bind its port: its own failure, not a peer's (seen under a loaded machine).
    bind = dist.DistNetworkError("The server socket has failed to listen on any local network address. port: 39067")
    assert not failures.is_broken_connection(bind)
    failures.describe(0, [0])
    Board.connect(2).record(failures.entry_index() + 1, Failure(1, (1,), "during training", "ValueError: theirs"))
    with pytest.raises(RuntimeError, match="invalid usage"):
        with failures.entry():
            raise own
    assert Board.connect(2).first(failures.entry_index()).rank == 1  # the board's first stays: first writer wins
    with pytest.raises(RuntimeError, match="inputs.size"):
        with failures.entry():
            raise size
    assert Board.connect(2).first(failures.entry_index()).sentence().startswith("Rank 0 (pipeline stage 0) failed")


def test_an_inner_entry_gives_the_outer_one_its_state_back():
    outer, inner = object(), object()
    with failures.entry(outer):
        index = failures.entry_index()
        with failures.phase("while saving a checkpoint"):
            with failures.entry(inner):
                assert failures.entry_index() == index + 1 and failures.current_phase() == "during start-up"
            assert failures.in_entry() and failures.entry_index() == index
            assert failures.current_phase() == "while saving a checkpoint"
        with pytest.raises(ValueError):
            with failures.entry(inner):
                raise ValueError("caught by the outer run")
        assert failures.in_entry() and failures.reported_at() is None and failures.entry_index() == index
    assert not failures.in_entry()


class InnerTrainer(L.Callback):
    """Runs a whole Trainer of its own inside the outer run's first training batch."""

    def __init__(self) -> None:
        self.seen: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx:
            return
        before = (failures.in_entry(), failures.entry_index(), failures.current_phase())
        inner = quiet_trainer(strategy=lightning_pipe.PipelineParallelStrategy(), devices=1, max_steps=1)
        inner.fit(LitLM(n_layers=2, samples=8))
        self.seen = {"before": before, "after": (failures.in_entry(), failures.entry_index(), failures.current_phase())}


def test_a_trainer_inside_a_callback_does_not_clear_the_outer_runs_failure_state():
    callback = InnerTrainer()
    outer = quiet_trainer(
        strategy=lightning_pipe.PipelineParallelStrategy(), devices=1, max_steps=2, callbacks=[callback]
    )
    outer.fit(LitLM(n_layers=2, samples=16))
    assert callback.seen["before"] == callback.seen["after"]
    assert callback.seen["after"][0] and callback.seen["after"][2] == "during training"


def test_launches_register_one_exit_handler(monkeypatch):
    registered = []
    monkeypatch.setattr(watchdog.atexit, "register", registered.append)
    monkeypatch.setattr(watchdog, "_JOIN_REGISTERED", False)
    monkeypatch.setattr(watchdog, "start", lambda: None)
    monkeypatch.setattr(watchdog, "_WATCH", watchdog._Watch(None))
    for _ in range(3):
        watchdog.watch_children([], 1, timedelta(seconds=5))
    assert len(registered) == 1 and watchdog._WATCH.join_timeout == 5.0


@pytest.mark.slow
def test_the_watchdog_starts_with_the_strategy_not_on_import():
    code = (
        "import threading, lightning_pipe\n"
        "names = lambda: [t.name for t in threading.enumerate()]\n"
        "print('import', 'lightning-pipe-watchdog' in names())\n"
        "lightning_pipe.PipelineParallelStrategy()\n"
        "print('strategy', 'lightning-pipe-watchdog' in names())\n"
    )
    env = clean_env(TORCHELASTIC_RUN_ID="x", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout
    assert "import False" in out and "strategy True" in out
