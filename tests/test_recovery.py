"""Recovery in place (``snapshot_every``): the snapshots, the buddy placement, the supervisor's generations, and a rank
SIGKILLed inside a step under Lightning's launcher, replaced while the others keep their processes, at 2 stages and at
2 stages x 2 data-parallel replicas (tests/scripts/restart.py; slow: the reference and the faulted run each start their
processes)."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch

from lightning_pipe import PipelineParallelStrategy
from lightning_pipe.checkpoint.snapshot import MEMORY, Snapshots, _from_bytes, _to_bytes, stage
from lightning_pipe.comm import collectives
from lightning_pipe.comm.mesh import MeshLayout
from lightning_pipe.errors import PipelineCheckpointError, PipelineConfigError
from lightning_pipe.reliability import recovery
from lightning_pipe.settings import AUTO_SNAPSHOT_EVERY
from tests import restarts
from tests.restarts import compare, losses, run


# ---------------------------------------------------------------------------------------------------- settings
@pytest.mark.parametrize("value", [-1, 1.5, "4"])
def test_snapshot_every_must_be_a_non_negative_int(value):
    with pytest.raises(PipelineConfigError, match=rf"`snapshot_every={value!r}`.*int >= 0"):
        PipelineParallelStrategy(snapshot_every=value, max_restarts=1)


def test_snapshot_every_needs_max_restarts():
    with pytest.raises(PipelineConfigError, match=r"`snapshot_every=4`.*`max_restarts=0`.*Set `max_restarts`"):
        PipelineParallelStrategy(snapshot_every=4)


@pytest.mark.parametrize("kwargs", [{"data_parallel": "fsdp"}, {"tensor_parallel": 2}])
def test_snapshot_every_refuses_sharded_stages(kwargs):
    with pytest.raises(PipelineConfigError, match=r"`snapshot_every=2`.*`data_parallel=.*`tensor_parallel=.*ddp"):
        PipelineParallelStrategy(snapshot_every=2, max_restarts=1, **kwargs)


def test_snapshot_every_reaches_the_settings():
    settings = PipelineParallelStrategy(snapshot_every=5, max_restarts=2, spares=1).settings
    assert settings.snapshot_every == 5 and settings.spares == 1


@pytest.mark.parametrize("value", [-1, 0.5])
def test_spares_must_be_a_non_negative_int(value):
    with pytest.raises(PipelineConfigError, match=rf"`spares={value!r}`.*int >= 0"):
        PipelineParallelStrategy(spares=value, snapshot_every=2, max_restarts=1)


@pytest.mark.parametrize("kwargs,shown", [({"snapshot_every": 0, "max_restarts": 1}, "0"), ({}, "'auto'")])
def test_spares_need_snapshots(kwargs, shown):
    with pytest.raises(PipelineConfigError, match=rf"`spares=1`.*`snapshot_every={shown}`.*Set `max_restarts`"):
        PipelineParallelStrategy(spares=1, **kwargs)


@pytest.mark.parametrize(
    "kwargs,interval",
    [
        ({}, 0),  # no supervisor, no snapshots
        ({"max_restarts": 2}, AUTO_SNAPSHOT_EVERY),
        ({"max_restarts": 2, "data_parallel": "fsdp"}, 0),  # sharded stages: restarts resume from disk
        ({"max_restarts": 2, "tensor_parallel": 2}, 0),
        ({"max_restarts": 2, "snapshot_every": 0}, 0),  # switched off
        ({"max_restarts": 2, "snapshot_every": 3}, 3),
    ],
)
def test_snapshot_every_auto_takes_snapshots_where_recovery_in_place_applies(kwargs, interval):
    settings = PipelineParallelStrategy(**kwargs).settings
    assert settings.snapshot_interval == interval
    assert settings.snapshot_every == kwargs.get("snapshot_every", "auto")


def test_the_auto_interval_is_the_measured_one():
    """docs/benchmarks.md (Recovery in place) gives the overhead measured at this interval on the GPT example."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    assert f"`snapshot_every='auto'` ({AUTO_SNAPSHOT_EVERY} steps)" in text


def test_fabric_refuses_recovery_in_place():
    from lightning_pipe import PipelineFabricStrategy
    from lightning_pipe.fabric import TRAINER_ONLY

    assert {"snapshot_every", "spares"} <= set(TRAINER_ONLY)
    with pytest.raises(PipelineConfigError, match=r"`max_restarts=1`.*Fabric"):
        PipelineFabricStrategy(snapshot_every=2, max_restarts=1)


# ---------------------------------------------------------------------------------------------------- placement
@pytest.mark.parametrize(
    "world,per_node,expected",
    [(2, 2, [1, 0]), (4, 4, [1, 2, 3, 0]), (4, 2, [2, 3, 0, 1]), (6, 2, [2, 3, 4, 5, 0, 1])],
)
def test_the_buddy_is_on_the_next_node_when_there_are_several(world, per_node, expected):
    assert [recovery.buddy_of(r, world, per_node) for r in range(world)] == expected
    assert [recovery.held_by(expected[r], world, per_node) for r in range(world)] == list(range(world))


# (stages, replicas, inner axis, ranks per node) -> each rank's buddy
REPLICATED = [
    ((2, 2, "dp", 4), [1, 0, 3, 2]),  # one node: the same stage in the other replica
    ((2, 2, "pp", 4), [2, 3, 0, 1]),
    ((2, 2, "pp", 2), [2, 3, 0, 1]),  # a pipeline per node: the other replica is on the other node
    ((2, 2, "dp", 2), [2, 3, 0, 1]),  # a stage per node: its replicas share the node, so the next node's rank
    ((2, 4, "dp", 4), [4, 5, 6, 7, 0, 1, 2, 3]),
    ((2, 3, "pp", 2), [2, 3, 4, 5, 0, 1]),  # the next replica, on the next node
    ((2, 4, "dp", 2), [2, 3, 0, 1, 6, 7, 4, 5]),  # two replicas further: another node, the same stage
]


@pytest.mark.parametrize("shape,expected", REPLICATED, ids=[f"{s}x{d}-{i}-{n}" for (s, d, i, n), _ in REPLICATED])
def test_the_buddy_is_the_same_stage_in_another_replica_on_another_node_where_one_is(shape, expected):
    stages, replicas, inner, per_node = shape
    layout = MeshLayout(stages, replicas, inner)
    positions = layout.stage_positions()
    world = layout.world_size
    assert recovery.buddies(world, per_node, positions) == expected
    assert [recovery.held_by(expected[r], world, per_node, positions) for r in range(world)] == list(range(world))
    assert sorted(expected) == list(range(world))  # a permutation: every rank sends one copy and keeps one


# ---------------------------------------------------------------------------------------------------- snapshots
def _submit(snapshots: Snapshots, step: int) -> None:
    weights = torch.full((2,), float(step))
    staged = stage({"global_step": step, "w": weights}, snapshots.pinned)
    weights += 100  # the optimizer's next step: the staged copy keeps the values of `step`
    snapshots.submit(step, staged, point=step, ranks_per_node=1)
    snapshots.wait()


def test_one_process_agrees_on_its_newest_snapshot_and_restores_a_copy():
    snapshots = Snapshots(every=4)
    for step in (4, 8, 12):
        _submit(snapshots, step)
    assert sorted(snapshots.own) == [12] and snapshots.complete == {12}  # older than the newest complete: dropped
    assert snapshots.agree(ranks_per_node=1) == 12
    checkpoint, point = snapshots.restore()
    assert checkpoint["global_step"] == 12 and point == 12 and torch.equal(checkpoint["w"], torch.full((2,), 12.0))
    assert snapshots.nbytes() == len(snapshots.own[12]) and snapshots.last_bytes == len(snapshots.own[12])


@contextlib.contextmanager
def _submitting(snapshots: Snapshots, step: int, exchange: Callable[..., bytes]) -> Iterator[None]:
    """Inside: the snapshot of ``step`` submitted by rank 0 of 2, its thread exchanging through ``exchange``."""
    staged = stage({"global_step": step, "w": torch.ones(2)}, snapshots.pinned)
    with (
        mock.patch.object(collectives, "group_size", return_value=2),
        mock.patch.object(collectives, "exchange_bytes", exchange),
    ):
        snapshots.submit(step, staged, point=step, ranks_per_node=2)
        yield


def test_a_snapshot_in_the_background_keeps_the_previous_complete_one_until_it_completes():
    """Both copies of step 8 exist everywhere (complete); step 12's thread fails in the exchange (the buddy was
    lost): step 8 stays, the error reaches the main thread at the next wait, and after the failure the thread
    changes nothing any more (abandoned)."""
    snapshots = Snapshots(every=4)
    snapshots.own[8], snapshots.held[8], snapshots.complete = b"own8", b"held8", {8}
    snapshots._group = (collectives.world_group(), "the snapshot group")  # as `use_group` made it in `setup`
    began, release = threading.Event(), threading.Event()
    lost = RuntimeError("Connection closed by peer")

    def exchange(data, to, source, group):
        began.set()
        release.wait(5)
        raise lost

    with _submitting(snapshots, 12, exchange):
        assert began.wait(5)
        assert sorted(snapshots.own) == [8, 12] and sorted(snapshots.held) == [8]  # 12 serialised, not exchanged
        release.set()
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            snapshots.wait()
    assert snapshots.complete == {8} and 8 in snapshots.own and 8 in snapshots.held

    began.clear()
    release.clear()
    staged = stage({"global_step": 16, "w": torch.ones(2)}, snapshots.pinned)
    with (
        mock.patch.object(collectives, "group_size", return_value=2),
        mock.patch.object(collectives, "exchange_bytes", lambda *a: (began.set(), release.wait(5), b"held16")[2]),
        mock.patch.object(collectives, "barrier"),
    ):
        snapshots.submit(16, staged, point=16, ranks_per_node=2)
        assert began.wait(5)
        snapshots.abandon()  # the entry failed meanwhile
        release.set()
        time.sleep(0.2)
    assert 16 not in snapshots.held and snapshots.complete == {8} and sorted(snapshots.own) == [8, 12, 16]


def test_an_abandoned_exchange_that_fails_later_raises_nothing_in_the_next_generation():
    """The thread of a snapshot abandoned after a failure stays blocked in its exchange until the broken run's groups
    are dropped, and then fails: that error belongs to the broken run, not to the next snapshot's wait."""
    snapshots = Snapshots(every=4)
    snapshots._group = (collectives.world_group(), "the snapshot group")  # as `use_group` made it in `setup`
    began, release = threading.Event(), threading.Event()

    def exchange(data, to, source, group):
        began.set()
        release.wait(5)
        raise RuntimeError("Connection closed by peer")

    with _submitting(snapshots, 12, exchange):
        assert began.wait(5)
        thread = snapshots._thread
        snapshots.abandon()
        release.set()
        thread.join(5)
    snapshots.wait()  # raises nothing
    assert 12 not in snapshots.held and snapshots.complete == set()


def test_a_completed_exchange_drops_the_older_copies():
    snapshots = Snapshots(every=4)
    snapshots.own[8], snapshots.held[8], snapshots.complete = b"own8", b"held8", {8}
    snapshots._group = (collectives.world_group(), "the snapshot group")  # as `use_group` made it in `setup`
    staged = stage({"global_step": 12}, snapshots.pinned)
    with (
        mock.patch.object(collectives, "group_size", return_value=2),
        mock.patch.object(collectives, "exchange_bytes", lambda *a: b"held12"),
        mock.patch.object(collectives, "barrier") as barrier,
    ):
        snapshots.submit(12, staged, point=12, ranks_per_node=2)
        snapshots.wait()
    barrier.assert_called_once()
    assert sorted(snapshots.own) == [12] and snapshots.held == {12: b"held12"} and snapshots.complete == {12}


def test_a_lost_peer_drops_the_snapshot_group_with_the_strategys_groups():
    """A survivor keeps no reference to the broken run's world group (gloo closes its connections with the last): a
    peer of another replica blocked on it in a world collective fails at once instead of waiting for the timeout."""
    strategy = PipelineParallelStrategy(snapshot_every=4, max_restarts=1)
    strategy._snapshots._group = (object(), object())  # as `use_group` made it for the run that broke
    with mock.patch.object(strategy._session, "release_groups") as session_groups:
        strategy._release_groups()
    session_groups.assert_called_once()
    assert strategy._snapshots._group is None


def test_no_snapshot_to_agree_on_is_refused():
    with pytest.raises(PipelineCheckpointError, match=r"No snapshot step.*rank 0: none.*newest checkpoint on disk"):
        Snapshots(every=4).agree(ranks_per_node=1)


def test_resuming_from_memory_without_a_recovery_is_refused():
    with pytest.raises(PipelineCheckpointError, match=rf"`ckpt_path={MEMORY!r}`.*recovery in place.*checkpoint path"):
        Snapshots(every=4).restore()


def test_a_snapshot_is_a_copy():
    """The staged copy is taken at the step (tensors cloned, the rest deep-copied): later changes do not reach it."""
    weights, loops = torch.zeros(3), {"epoch": [0]}
    staged = stage({"w": weights, "loops": loops, "same": [weights]}, {})
    weights += 1
    loops["epoch"].append(1)
    assert torch.equal(staged.checkpoint["w"], torch.zeros(3)) and staged.checkpoint["loops"] == {"epoch": [0]}
    assert staged.checkpoint["same"][0] is staged.checkpoint["w"]  # one tensor, one copy
    assert torch.equal(_from_bytes(_to_bytes(staged.checkpoint))["w"], torch.zeros(3))


# ---------------------------------------------------------------------------------------------------- generations
def test_a_survivor_waits_for_the_next_generation(tmp_path, monkeypatch):
    file = tmp_path / "recovery.json"
    monkeypatch.setenv(recovery.RECOVERY_FILE, str(file))
    recovery.announce(file, 0, 1234, [])
    assert recovery.await_generation(0, wait=0.2) is None  # none announced yet
    recovery.announce(file, 1, 4321, [1])
    assert recovery.await_generation(0, wait=0.2) == (1, 4321)
    assert not recovery.is_recovered(file, 1) and recovery.is_recovered(file, 0)
    monkeypatch.setenv(recovery.GENERATION, "1")
    recovery.mark_recovered(recovery.generation())
    assert recovery.is_recovered(file, 1)
    recovery.fall_back(file)
    assert recovery.await_generation(0, wait=5) is None  # at once: the supervisor restarts every rank
    assert json.loads(file.read_text())["fallback"] is True


# ---------------------------------------------------------------------------------------------------- 2 processes
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run without a fault, without snapshots and without checkpoint files (shared with the fault matrix)."""
    return restarts.uninterrupted(tmp_path_factory.getbasetemp(), 2)


@pytest.mark.slow
# rank 0 and spares: test_a_second_kill_is_taken_by_the_spare_started_after_the_first, and the extended fault matrix
@pytest.mark.parametrize(
    "killed,spares,every,step,snapshot",
    [(1, 0, "auto", AUTO_SNAPSHOT_EVERY + 2, AUTO_SNAPSHOT_EVERY)],
    ids=["rank1-new-process-auto"],
)
def test_a_rank_killed_in_a_step_is_replaced_in_place_exactly(
    uninterrupted, tmp_path, killed, spares, every, step, snapshot
):
    """A rank SIGKILLed in its stage's forward of a step (snapshots by default: `'auto'`; no checkpoint on disk): the
    supervisor gives its place to a new process or a waiting spare, the other rank keeps its process, both resume from
    the newest snapshot in memory, and every logged loss and the final weights equal the uninterrupted run's (without
    snapshots) bit for bit."""
    cfg = {"devices": 2, "disk": False, "snapshot_every": every, "spares": spares}
    proc = run(tmp_path, {**cfg, "kill": {"rank": killed, "step": step, "where": "step"}}, "lightning")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    outcome = compare(tmp_path, uninterrupted, 2)
    assert outcome.problems == [], output[-4000:]
    assert outcome.attempts == 1 and outcome.resumed_from == snapshot and outcome.completed == step - 1
    by = "spare 0" if spares else "a new process"
    assert f"replacing it in place by {by} (generation 1" in output
    assert f"resuming `fit` from the snapshot of step {snapshot}" in output
    survivor = 1 - killed
    assert (tmp_path / f"pid.rank{survivor}.attempt0").read_text() == (tmp_path / f"pid_end.rank{survivor}").read_text()
    replacement = f"pid.rank{2 if spares else killed}.{'attempt0' if spares else 'generation1'}"
    assert (tmp_path / replacement).read_text() == (tmp_path / f"pid_end.rank{killed}").read_text()
    assert not list(tmp_path.glob("**/*.ckpt")) and "resuming `fit` from '" not in output  # nothing on disk to read
    redone = [r["step"] for r in losses(tmp_path, survivor) if r["generation"] == 1]
    assert redone[0] == snapshot + 1 and redone[-1] == max(r["step"] for r in losses(uninterrupted, 0))


@pytest.mark.slow
def test_a_second_kill_is_taken_by_the_spare_started_after_the_first(uninterrupted, tmp_path):
    """``spares=1``, rank 0 killed in step 10 and rank 1 in step 18 of the next generation (no checkpoint on disk):
    spare 0 takes rank 0's place, the supervisor starts spare 1 once that recovery completed, and spare 1 takes rank
    1's place; both recoveries resume from the newest snapshot (8, then 16), exact."""
    kills = [{"rank": 0, "step": 10, "where": "step"}, {"rank": 1, "step": 18, "where": "step", "generation": 1}]
    proc = run(tmp_path, {"devices": 2, "disk": False, "snapshot_every": 4, "spares": 1, "kills": kills}, "lightning")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    outcome = compare(tmp_path, uninterrupted, 2)
    assert outcome.problems == [] and outcome.attempts == 1, output[-4000:]
    assert re.search(r"rank 0 failed \(.*SIGKILL\); replacing it in place by spare 0 \(generation 1", output)
    assert re.search(r"rank 1 failed \(.*SIGKILL\); replacing it in place by spare 1 \(generation 2", output)
    resumed = [json.loads(line) for line in (tmp_path / "resumed.rank1.jsonl").read_text().splitlines()]
    assert [(r["generation"], r["from_step"]) for r in resumed] == [(1, 8), (2, 16)]
    # Spare 1 (local rank 3 while it waited) is the process that ended as rank 1; spare 0 ended as rank 0.
    assert (tmp_path / "pid.rank3.attempt0").read_text() == (tmp_path / "pid_end.rank1").read_text()
    assert (tmp_path / "pid.rank2.attempt0").read_text() == (tmp_path / "pid_end.rank0").read_text()


@pytest.mark.slow
@pytest.mark.extended
def test_a_kill_before_the_first_snapshot_falls_back_to_the_restart_from_disk(uninterrupted, tmp_path):
    """Killed in step 3, before the step-4 snapshot: the survivor says so and ends, the supervisor starts every rank
    again, and the run starts from the beginning (no checkpoint yet), exact."""
    cfg = {"devices": 2, "snapshot_every": 4, "kill": {"rank": 1, "step": 3, "where": "step"}}
    proc = run(tmp_path, cfg, "lightning")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "no snapshot in memory yet; every rank starts again from the newest checkpoint on disk" in output
    assert "recovery in place (generation 1) failed; every rank starts again" in output
    outcome = compare(tmp_path, uninterrupted, 2)
    assert outcome.problems == [] and outcome.attempts == 2, output[-4000:]


# ---------------------------------------------------------------------------------------------------- 2 x 2
@pytest.fixture(scope="module")
def uninterrupted_2x2(tmp_path_factory):
    """2 stages x 2 data-parallel replicas (DistributedSampler) without a fault, snapshots or checkpoint files (shared
    with the fault matrix)."""
    return restarts.uninterrupted(tmp_path_factory.getbasetemp(), 4)


@pytest.mark.slow
@pytest.mark.extended
def test_a_rank_of_a_replicated_pipeline_killed_in_a_step_is_replaced_in_place_exactly(uninterrupted_2x2, tmp_path):
    """2 stages x 2 replicas: rank 1 (stage 0 of replica 1) SIGKILLed in its forward of step 10. Its pipeline peer
    and its replica peer see the broken connection; rank 2 (stage 1 of replica 0), blocked in its gradient
    all-reduce with rank 3, fails once rank 3 dropped its groups. Every rank keeps its process but rank 1's, whose
    snapshot of step 8 comes from its buddy rank 0 (the same stage in the other replica); every logged loss and the
    final weights equal the uninterrupted run's bit for bit."""
    cfg = {"devices": 4, "disk": False, "snapshot_every": 4, "kill": {"rank": 1, "step": 10, "where": "step"}}
    proc = run(tmp_path, cfg, "lightning")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    outcome = compare(tmp_path, uninterrupted_2x2, 4)
    assert outcome.problems == [], output[-4000:]
    assert outcome.attempts == 1 and outcome.resumed_from == 8 and outcome.completed == 9
    assert "replacing it in place by a new process (generation 1" in output
    assert "resuming `fit` from the snapshot of step 8" in output
    for survivor in (0, 2, 3):
        assert f"rank {survivor}: PipelinePeerFailure" in output
        pid = (tmp_path / f"pid.rank{survivor}.attempt0").read_text()
        assert pid == (tmp_path / f"pid_end.rank{survivor}").read_text()
    assert (tmp_path / "pid.rank1.generation1").read_text() == (tmp_path / "pid_end.rank1").read_text()
    assert not list(tmp_path.glob("**/*.ckpt")) and "resuming `fit` from '" not in output  # nothing on disk to read
    for rank in range(4):
        redone = [r["step"] for r in losses(tmp_path, rank) if r["generation"] == 1]
        assert redone[0] == 9 and redone[-1] == max(r["step"] for r in losses(uninterrupted_2x2, rank))
