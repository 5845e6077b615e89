"""Recovery in place against today's restart, in the same run of this script: time from a SIGKILL to the next
completed training step, exactness, and what the snapshots cost.

tests/scripts/restart.py (a 2-stage LM with dropout, a shuffling loader, validation every 5 steps, 24 steps) under
Lightning's launcher; ranks SIGKILLed inside their stage's forward, alternating ranks 1 and 0. Kinds of run,
interleaved:

- ``reference``: uninterrupted, no snapshots, no checkpoint files (the losses and weights every run must equal);
- ``in-place-spare``: ``snapshot_every=4``, ``spares=1``, no checkpoint files: up to ``--per-run`` kills in one run
  (steps 6, 10, 14, 18, 22, one per generation; ``max_restarts`` as many): a waiting spare takes the killed rank's
  place, the survivor keeps its process, both resume from the newest snapshot in memory; the supervisor starts a new
  spare after each recovery, and each kill waits until it reached ``fit`` (a failure hours later finds it ready);
- ``in-place``: the same without a spare: a new process takes the place;
- ``relaunch``: today's path: checkpoints every 5 steps on disk, one kill in step ``--step``, every rank started
  again (``max_restarts=3``), resumed from disk.

Per kill: from the kill, and from the end of the last step before it, to the end of the first step after the
recovery (the issue's measure: "from the last step before the kill to the first step after it"); per run: exact
(every logged training and validation loss and the final weights bit for bit equal to the reference's); for in-place
runs also the step time of the steps that took a snapshot against the others, and the host memory of the snapshots
per rank.

    flock /tmp/bench.lock nice python benchmarks/recovery.py --kills 10 --kinds in-place-spare relaunch --out DIR
    nice python benchmarks/recovery.py --kills 2 --per-run 1 --out /tmp/recovery-bench
    nice python benchmarks/recovery.py --replicas 2 --kills 2 --per-run 1 --out /tmp/recovery-2x2

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


#: The steps the kills of one in-place run come in (one per generation), after the snapshots of 4, 8, ... 20.
IN_PLACE_STEPS = (6, 10, 14, 18, 22)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def kill_times(out: Path, relaunch: bool) -> list[dict]:
    """For each kill of a run (in order): seconds from it, and from the end of the last step before it, to the end of
    the first step after the recovery. The last step before it is the later of the two ranks' (a rank killed in the
    next step may wait for its spare before that step, and the other rank has recorded its step's end already); the
    first after is the earlier of theirs."""
    steps, rows = losses(out, 0) + losses(out, 1), []
    for kill in _jsonl(out / "injected.jsonl"):
        before = [r["time"] for r in steps if r["time"] < kill["time"]]
        after = [
            r["time"]
            for r in steps
            if (r["attempt"] == 1 if relaunch else r.get("generation", 0) == kill["generation"] + 1)
        ]
        if not after:
            rows.append({"rank": kill["rank"], "kill_to_next_step_s": None, "last_step_to_next_step_s": None})
            continue
        rows.append(
            {
                "rank": kill["rank"],
                "kill_to_next_step_s": min(after) - kill["time"],
                "last_step_to_next_step_s": min(after) - max(before) if before else None,
            }
        )
    return rows


def measure(
    out: Path, kind: str, killed: tuple[int, int], kills: int, step: int, reference: Path, devices: int = 2
) -> dict:
    """One run of ``kind``: ranks ``killed[0]``, ``killed[1]``, ``killed[0]``, ... SIGKILLed in turn."""
    relaunch = kind == "relaunch"
    cfg: dict = {"devices": devices, "disk": relaunch}
    if relaunch:
        cfg["kill"] = {"rank": killed[0], "step": step, "where": "step"}
    else:
        cfg["kills"] = [
            {"rank": killed[g % 2], "step": IN_PLACE_STEPS[g], "where": "step", "generation": g} for g in range(kills)
        ]
        cfg.update(snapshot_every=SNAPSHOT_EVERY, spares=1 if kind == "in-place-spare" else 0, max_restarts=kills)
        cfg["await_spare"] = kind == "in-place-spare"
    proc = run(out, cfg, "lightning")
    outcome = compare(out, reference, devices)
    row = {
        "kind": kind,
        "devices": devices,
        "exit": proc.returncode,
        "exact": not outcome.problems,
        "problems": outcome.problems[:3],
        "kills": kill_times(out, relaunch),
        "redone": outcome.recomputed,
    }
    if not relaunch:
        times = _step_times(out, 0 if killed[0] else 1)  # a survivor's steps before the first kill
        with_snapshot = [t for s, t in times.items() if (s - 1) % SNAPSHOT_EVERY == 0 and s > 1]
        without = [t for s, t in times.items() if (s - 1) % SNAPSHOT_EVERY != 0]
        row["step_s_after_snapshot"] = statistics.median(with_snapshot) if with_snapshot else None
        row["step_s_other"] = statistics.median(without) if without else None
        stats = [json.loads((out / f"snapshot.rank{r}.json").read_text()) for r in range(devices)]
        row["snapshot_bytes_per_rank"] = [s["bytes"] for s in stats]
        row["snapshot_blocking_s"] = [s["last_seconds"] for s in stats]
    return row


def _summary(kind: str, rows: list[dict]) -> str:
    mine = [r for r in rows if r["kind"] == kind]
    kills = [k for r in mine for k in r["kills"]]
    exact = sum(r["exact"] and r["exit"] == 0 for r in mine)
    parts = [f"{kind}: {exact} of {len(mine)} runs exact, {len(kills)} kills"]
    for key in ("last_step_to_next_step_s", "kill_to_next_step_s"):
        values = sorted(k[key] for k in kills if k[key] is not None)
        if values:
            shown = ", ".join(f"{v:.1f}" for v in values)
            parts.append(f"{key} median {statistics.median(values):.2f} s, max {values[-1]:.1f} s ({shown})")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=3, help="kills per kind of run")
    parser.add_argument("--per-run", type=int, default=5, help="kills in one in-place run (at most 5)")
    parser.add_argument("--relaunches", type=int, default=None, help="relaunch runs (default: --kills)")
    parser.add_argument("--step", type=int, default=10, help="the training step a relaunch run's rank is killed in")
    parser.add_argument(
        "--replicas", type=int, choices=(1, 2), default=1, help="data-parallel replicas of the pipeline"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kinds", nargs="+", default=["in-place-spare", "in-place", "relaunch"], help="runs per kill")
    args = parser.parse_args()
    per_run = max(1, min(args.per_run, len(IN_PLACE_STEPS)))
    devices = 2 * args.replicas
    killed = [(1, 0), (0, 1)] if args.replicas == 1 else [(1, 2), (2, 1)]
    reference = args.out / "reference"
    if (reference / "final.rank0.pt").exists():
        pass  # made by an earlier run of this script in the same directory
    elif run(reference, {"devices": devices, "disk": False}, "lightning").returncode != 0:
        raise SystemExit(f"the reference run failed: {reference / 'output.log'}")
    left = {
        kind: args.relaunches if kind == "relaunch" and args.relaunches is not None else args.kills
        for kind in args.kinds
    }
    rows, i = [], 0
    while any(left.values()):
        for kind in args.kinds:
            if not left[kind]:
                continue
            kills = 1 if kind == "relaunch" else min(per_run, left[kind])
            row = measure(args.out / f"{kind}-{i}", kind, killed[i % 2], kills, args.step, reference, devices)
            left[kind] -= kills
            print(json.dumps(row), flush=True)
            rows.append(row)
        i += 1
    for kind in args.kinds:
        print(_summary(kind, rows))
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
