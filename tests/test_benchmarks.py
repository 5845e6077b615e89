"""benchmarks/run.py: the report arithmetic on known records, and a smoke run of every case (`--quick`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from argparse import Namespace

import pytest

from benchmarks import report
from tests.launch import ROOT, clean_env


def _record(suite, kind, run, ms, model="small", schedule=None, microbatches=None, note=None):
    case = {"suite": suite, "kind": kind, "model": model, "run": run, "schedule": schedule}
    case.update(microbatches=microbatches, note=note)
    return {"case": case, "ms": ms, "cpu_ms": [2 * x for x in ms]}


def test_overhead_and_speedup_are_taken_run_by_run():
    records = [{"machine": {"cpu": "x"}, "world_size": 2}]
    for run, (hand, strategy) in enumerate([(4.0, 5.0), (8.0, 9.5), (4.2, 5.0)]):
        records.append(_record("small", "hand", run, [hand, hand + 1, hand - 1], schedule="1F1B", microbatches=4))
        records.append(_record("small", "strategy", run, [strategy], schedule="1F1B", microbatches=4))
        records.append(_record("speedup", "single_hand", run, [300.0], model="compute", microbatches=8))
        records.append(_record("speedup", "strategy", run, [200.0], model="compute", schedule="GPipe", microbatches=8))
    results = report.collect(records, Namespace(quick=False, runs=3), 10.0)
    row = results["overhead"]["small"][0]
    assert row["a"]["runs"] == [4.0, 8.0, 4.2] and row["b"]["runs"] == [5.0, 9.5, 5.0]
    assert row["diff"]["median"] == pytest.approx(1.0) and row["diff"]["max"] == pytest.approx(1.5)
    assert results["overhead"]["targets"]["small_overhead_ms"] == pytest.approx(1.0)
    (speedup,) = results["speedup"]
    assert speedup["speedup"]["median"] == pytest.approx(1.5)
    assert speedup["ideal"] == pytest.approx(16 / 9)


def test_the_generated_section_replaces_only_itself(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# Benchmarks\n\nintro\n\n{report.BEGIN}\nold\n{report.END}\n\n## Kept\n")
    records = [_record("small", "hand", 0, [4.0], schedule="1F1B", microbatches=4)]
    records.append(_record("small", "strategy", 0, [5.0], schedule="1F1B", microbatches=4))
    report.write_docs(report.collect(records, Namespace(quick=False, runs=1), 1.0), docs, [])
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n\n") and text.endswith(f"{report.END}\n\n## Kept\n")
    assert "old" not in text and "| 1F1B | 4.00 (4.00-4.00) | 5.00 (5.00-5.00) | 1.00 (1.00-1.00) |" in text


@pytest.mark.slow
def test_quick_run_writes_every_output(tmp_path):
    """The CI smoke: every case once on a tiny network, results and plots written, the docs left alone."""
    pytest.importorskip("matplotlib")
    docs_before = (ROOT / "docs" / "benchmarks.md").read_text()
    out = tmp_path / "out"
    page = tmp_path / "benchmarks.md"
    shutil.copyfile(ROOT / "docs" / "benchmarks.md", page)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--out", str(out), "--docs", str(page)]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["quick"] and results["machine"]["torch"]
    assert {r["schedule"] for r in results["overhead"]["small"]} == {"1F1B", "ZBVZeroBubble"}
    assert results["speedup"] and results["ddp"] and results["eval"] and results["timeline"]["bubbles"]
    assert {p.name for p in (out / "img").iterdir()} >= {"overhead.png", "speedup.png", "timeline-1F1B-M8.png"}
    assert "`--quick`: a smoke run" in page.read_text()
    assert (ROOT / "docs" / "benchmarks.md").read_text() == docs_before
