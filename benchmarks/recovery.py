"""Recovery in place against today's restart, in the same run of this script: time from a SIGKILL to the next
completed training step, exactness, and what the snapshots cost.

tests/scripts/restart.py (a 2-stage LM with dropout, a shuffling loader, validation every 5 steps, 24 steps) under
Lightning's launcher with ``max_restarts=3``; one rank SIGKILLed inside its stage's forward of step ``--step``,
alternating ranks 1 and 0. Three kinds of run, interleaved:

- ``reference``: uninterrupted, no snapshots, no checkpoint files (the losses and weights every run must equal);
- ``in-place``: ``snapshot_every=4``, no checkpoint files: the supervisor replaces the killed rank by a new process,
  the survivor keeps its process, both resume from the newest snapshot in memory;
- ``in-place-spare``: the same with ``spares=1``: a process started with the run, waiting at ``fit``, takes the place;
- ``relaunch``: today's path: checkpoints every 5 steps on disk, every rank started again, resumed from disk.

Per run: kill to the end of the first step after it, steps redone, exact (every logged loss and the final weights
bit for bit equal to the reference's); for in-place runs also the step time of the steps that took a snapshot
against the others, and the host memory of the snapshots per rank.

    nice python benchmarks/recovery.py --kills 3 --out /tmp/recovery-bench
    nice python benchmarks/recovery.py --kinds in-place-spare --kills 2 --out /tmp/recovery-spare
    nice python benchmarks/recovery.py --replicas 2 --kills 1 --out /tmp/recovery-2x2

``--replicas 2``: 2 stages x 2 data-parallel replicas (4 processes, Lightning's DistributedSampler), ranks 1 (stage 0
of replica 1) and 2 (stage 1 of replica 0) killed in turn.

Results: docs/benchmarks.md and docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.restarts import compare, losses, run  # noqa: E402

SNAPSHOT_EVERY = 4


def _step_times(out: Path, rank: int) -> dict[int, float]:
    """Seconds each step took (from the previous step's end), in the first generation of the first attempt."""
    records = [r for r in losses(out, rank) if r.get("generation", 0) == 0 and r["attempt"] == 0]
    return {b["step"]: b["time"] - a["time"] for a, b in zip(records, records[1:])}


def measure(out: Path, kind: str, kill_rank: int, step: int, reference: Path, devices: int = 2) -> dict:
    cfg: dict = {
        "devices": devices,
        "disk": kind == "relaunch",
        "kill": {"rank": kill_rank, "step": step, "where": "step"},
    }
    if kind.startswith("in-place"):
        cfg["snapshot_every"] = SNAPSHOT_EVERY
        cfg["spares"] = 1 if kind == "in-place-spare" else 0
    proc = run(out, cfg, "lightning")
    outcome = compare(out, reference, devices)
    row = {
        "kind": kind,
        "devices": devices,
        "rank": kill_rank,
        "exit": proc.returncode,
        "exact": not outcome.problems,
        "problems": outcome.problems[:3],
        "kill_to_next_step_s": outcome.failure_to_first_step,
        "redone": outcome.recomputed,
    }
    if kind.startswith("in-place"):
        times = _step_times(out, 1 if kill_rank == 0 else 0)  # a survivor's steps before the kill
        with_snapshot = [t for s, t in times.items() if (s - 1) % SNAPSHOT_EVERY == 0 and s > 1]
        without = [t for s, t in times.items() if (s - 1) % SNAPSHOT_EVERY != 0]
        row["step_s_after_snapshot"] = statistics.median(with_snapshot) if with_snapshot else None
        row["step_s_other"] = statistics.median(without) if without else None
        stats = [json.loads((out / f"snapshot.rank{r}.json").read_text()) for r in range(devices)]
        row["snapshot_bytes_per_rank"] = [s["bytes"] for s in stats]
        row["snapshot_blocking_s"] = [s["last_seconds"] for s in stats]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=3, help="kills per kind of run")
    parser.add_argument("--step", type=int, default=10, help="the training step the rank is killed in")
    parser.add_argument(
        "--replicas", type=int, choices=(1, 2), default=1, help="data-parallel replicas of the pipeline"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kinds", nargs="+", default=["in-place-spare", "in-place", "relaunch"], help="runs per kill")
    args = parser.parse_args()
    devices = 2 * args.replicas
    killed = (1, 0) if args.replicas == 1 else (1, 2)
    reference = args.out / "reference"
    if (reference / "final.rank0.pt").exists():
        pass  # made by an earlier run of this script in the same directory
    elif run(reference, {"devices": devices, "disk": False}, "lightning").returncode != 0:
        raise SystemExit(f"the reference run failed: {reference / 'output.log'}")
    rows = []
    for i in range(args.kills):
        for kind in args.kinds:
            row = measure(args.out / f"{kind}-{i}", kind, killed[i % 2], args.step, reference, devices)
            print(json.dumps(row), flush=True)
            rows.append(row)
    for kind in args.kinds:
        mine = [r for r in rows if r["kind"] == kind]
        times = [r["kill_to_next_step_s"] for r in mine if r["kill_to_next_step_s"] is not None]
        exact = sum(r["exact"] and r["exit"] == 0 for r in mine)
        median = statistics.median(times) if times else float("nan")
        print(f"{kind}: {exact} of {len(mine)} exact; kill to next step median {median:.1f} s, max {max(times):.1f} s")
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
