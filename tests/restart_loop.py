"""The restart fault loop: runs of tests/scripts/restart.py in which a random rank is SIGKILLed at a random step (in
its stage's forward, or while it writes its shards of a checkpoint, asynchronously or not), under torchrun
``--max-restarts=3`` and under Lightning's launcher with ``max_restarts=3``; every run must finish, and every step it
trained and its final weights must equal the uninterrupted run's, bit for bit (tests/restarts.py).

    nice python tests/restart_loop.py --runs 20 --devices 2 --out /tmp/restart-loop
    nice python tests/restart_loop.py --runs 20 --devices 4 --out /tmp/restart-loop

Prints one line per run and a summary (the figures in docs/reliability.md); exits non-zero if a run had a problem.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.restarts import compare, reference, run  # noqa: E402
from tests.scripts.restart import EVERY, STEPS  # noqa: E402


def scenarios(runs: int, devices: int, seed: int) -> list[tuple[str, dict]]:
    """``runs`` scenarios: launchers and save modes alternate, the rank, the step and the place are drawn."""
    rng = random.Random(seed)
    chosen = []
    for i in range(runs):
        where = "write" if i % 3 == 2 else "step"
        # A kill while writing needs a save still to come; one in a step any step after the first.
        step = rng.randint(1, STEPS - EVERY) if where == "write" else rng.randint(2, STEPS)
        # Only the first replica's pipeline writes shards (ranks 0 and 2 of 2 x 2, inner_axis="dp").
        ranks = [0, 2] if where == "write" and devices == 4 else list(range(devices))
        kill = {"rank": rng.choice(ranks), "step": step, "where": where}
        chosen.append((("torchrun", "lightning")[i % 2], {"devices": devices, "async": i % 4 < 2, "kill": kill}))
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--devices", type=int, choices=(2, 4), default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/restart-loop"))
    args = parser.parse_args()
    ref = reference(args.out, args.devices)
    results = []
    for i, (launcher, cfg) in enumerate(scenarios(args.runs, args.devices, args.seed)):
        out = args.out / f"{args.devices}p-{i:02d}-{launcher}"
        start = time.time()
        proc = run(out, cfg, launcher)
        outcome = compare(out, ref, args.devices)
        problems = outcome.problems + ([] if proc.returncode == 0 else [f"exit code {proc.returncode}"])
        row = {
            "run": i,
            "launcher": launcher,
            **cfg,
            "returncode": proc.returncode,
            "attempts": outcome.attempts,
            "completed": outcome.completed,
            "resumed_from": outcome.resumed_from,
            "recomputed": outcome.recomputed,
            "failure_to_first_step": outcome.failure_to_first_step,
            "wall": time.time() - start,
            "problems": problems,
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    (args.out / f"results-{args.devices}p.json").write_text(json.dumps(results, indent=1))
    summary(results)
    sys.exit(1 if any(r["problems"] for r in results) else 0)


def summary(results: list[dict]) -> None:
    ok = [r for r in results if not r["problems"]]
    print(f"{len(ok)} of {len(results)} runs finished with every step and the final weights equal to the reference")
    for launcher in ("torchrun", "lightning", None):
        rows = [r for r in results if launcher in (None, r["launcher"]) and r["failure_to_first_step"] is not None]
        if not rows:
            continue
        times = [r["failure_to_first_step"] for r in rows]
        again = [r["recomputed"] for r in rows]
        name, middle = launcher or "all", statistics.median(times)
        print(
            f"{name} ({len(rows)}): failure -> first step after resume median {middle:.1f} s, max {max(times):.1f} s;"
            f" steps recomputed median {statistics.median(again)}, max {max(again)}"
        )


if __name__ == "__main__":
    main()
