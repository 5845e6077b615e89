"""Run the fault matrix of tests/test_reliability.py repeatedly, outside pytest, and count hangs and other problems.

    python tests/reliability_loop.py --matrix ci --repeat 10 --json reliability-ci.json
    python tests/reliability_loop.py --matrix full --json reliability-full.json

Prints one line per run (scenario, seconds from the failure until every process was gone, launcher exit code,
problems) and a summary per scenario kind; ``--json`` keeps every run. Exit code 1 if any run had a problem. The
results are in docs/reliability.md. Run it alone (``nice`` on a shared machine): each run starts 2 or 4 processes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.faults import ci_matrix, full_matrix, run_fault  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", choices=["ci", "full"], default="ci")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="write every run's result here")
    args = parser.parse_args(argv)
    matrix = ci_matrix() if args.matrix == "ci" else full_matrix()
    results = []
    start = time.time()
    for round_ in range(args.repeat):
        for launcher, cfg in matrix:
            out = Path(tempfile.mkdtemp(prefix="lightning-pipe-fault-"))
            run = run_fault(out, cfg, launcher)
            problems = run.problems(out)
            results.append(
                {
                    "round": round_,
                    "name": run.name,
                    "launcher": launcher,
                    **cfg,
                    "all_gone_after": run.all_gone_after,
                    "launcher_exit_after": run.launcher_exit_after,
                    "returncode": run.returncode,
                    "problems": problems,
                }
            )
            gone = f"{run.all_gone_after:5.1f} s" if run.all_gone_after is not None else "  HANG "
            print(f"[{round_}] {run.name:45s} gone {gone}  rc {run.returncode}  {'; '.join(problems) or 'ok'}")
            sys.stdout.flush()
            if problems:
                (out / "output.txt").write_text(run.output)
                print(f"    kept {out} (output.txt)")
            else:
                shutil.rmtree(out, ignore_errors=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    _summary(results, time.time() - start)
    return 1 if any(r["problems"] for r in results) else 0


def _summary(results: list[dict], seconds: float) -> None:
    failed = sum(bool(r["problems"]) for r in results)
    print(f"\n{len(results)} runs in {seconds / 60:.1f} min; with problems: {failed}")
    hangs = [r for r in results if r["all_gone_after"] is None]
    print(f"hangs (a process alive 60 s after the failure): {len(hangs)}")
    for key in ("launcher", "devices", "phase", "action"):
        for value in sorted({r[key] for r in results}, key=str):
            times = [r["all_gone_after"] for r in results if r[key] == value and r["all_gone_after"] is not None]
            if times:
                median, worst = statistics.median(times), max(times)
                label = f"{key}={value}"
                print(f"  {label:22s} runs {len(times):3d}  all gone after: median {median:4.1f} s, max {worst:4.1f} s")


if __name__ == "__main__":
    sys.exit(main())
