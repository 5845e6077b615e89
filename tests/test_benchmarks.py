"""benchmarks/run.py: the report arithmetic on known records, and a smoke run of every case (`--quick`)."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
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
        hand_compute = [190.0, 200.0, 160.0][run]
        records.append(
            _record("overhead", "hand", run, [hand_compute], model="compute", schedule="GPipe", microbatches=8)
        )
    results = report.collect(records, Namespace(quick=False, runs=3), 10.0)
    row = results["overhead"]["small"][0]
    assert row["a"]["runs"] == [4.0, 8.0, 4.2] and row["b"]["runs"] == [5.0, 9.5, 5.0]
    assert row["diff"]["median"] == pytest.approx(1.0) and row["diff"]["max"] == pytest.approx(1.5)
    targets = results["overhead"]["targets"]
    assert targets["small_overhead_ms"] == pytest.approx(1.0)
    # the paired differences 1.0, 1.5, 0.8: mean 1.1, 95% interval 1.1 -+ t(2) * sd / sqrt(3)
    half = 4.303 * statistics.stdev([1.0, 1.5, 0.8]) / math.sqrt(3)
    ci = targets["small_overhead_ci"]
    assert (ci["mean"], ci["low"], ci["high"]) == pytest.approx((1.1, 1.1 - half, 1.1 + half))
    # the compute-bound ratios run by run: 200/190, 200/200, 200/160
    ratios = [200 / 190, 1.0, 1.25]
    assert targets["compute_ratio"] == pytest.approx(200 / 190) and targets["compute_ratio_schedule"] == "GPipe"
    assert targets["compute_ratio_ci"]["mean"] == pytest.approx(statistics.fmean(ratios))
    assert targets["compute_ratio_ci"]["high"] > 1.25 > 1.0 > targets["compute_ratio_ci"]["low"]
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


def test_the_frontend_table_pairs_neighbouring_trainers_round_by_round():
    from benchmarks.frontends import table

    rows = []
    for round_, (modules, dataflow) in enumerate([(100.0, 110.0), (200.0, 200.0), (100.0, 90.0)]):
        rows.append({"round": round_, "frontend": "modules", "wall_ms": modules, "cpu_ms": 2 * modules})
        rows.append({"round": round_, "frontend": "dataflow", "wall_ms": dataflow, "cpu_ms": 2 * dataflow})
    rows.append({"round": 3, "frontend": "modules", "wall_ms": 500.0, "cpu_ms": 1000.0})  # no partner: left out
    line = table({"gpt": rows}).splitlines()[-1]
    # medians (lowest to highest); ratios 1.1, 1.0, 0.9; geometric mean 0.997; CPU differences 20, 0, -20
    assert line.startswith("| gpt | 100.00 (100.00 to 200.00) | 110.00 (90.00 to 200.00) | 1.00 (0.90 to 1.10) |")
    assert "| 0.997 [0.890, 1.117] |" in line and line.endswith("| 0.00 (-20.00 to 20.00) |")


@pytest.mark.extended
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
    # the phases suite ran inside the same launch: one round, every phase of both loops
    phases = results["phases"]
    assert phases["rounds"] == 1 and phases["diff_cpu"]["n"] == 1
    # and the two loops alternating step by step: 2 pairs after the warm-up step
    assert phases["alternating"]["rounds"] == 1 and phases["alternating"]["ratio_wall"]["mean"] > 0
    # and Lightning's loop driving the hand loop, alternating with it (`phases.py --alternate --floor`)
    assert phases["floor"]["rounds"] == 1 and phases["floor"]["ratio_wall"]["mean"] > 0
    assert all(row["hand"] is not None and row["strategy"] is not None for row in phases["table"])
    assert "1 rounds of 1 steps after 1 warm-up steps" in page.read_text()  # its section rewritten
    assert results["speedup"] and results["ddp"] and results["eval"] and results["timeline"]["bubbles"]
    assert {p.name for p in (out / "img").iterdir()} >= {"overhead.png", "speedup.png", "timeline-1F1B-M8.png"}
    assert "`--quick`: a smoke run" in page.read_text()
    assert "(one run, no interval)" in page.read_text()  # one run: its target line says it has no interval
    assert (ROOT / "docs" / "benchmarks.md").read_text() == docs_before


# ------------------------------------------------------------------------------------------------ benchmarks/tune.py
def _sweep(run, settings, ms):
    return {"case": {"kind": "sweep", "workload": "mlp", "run": run, "settings": settings}, "ms": ms}


def test_tune_report_compares_the_choice_with_the_sweep():
    from benchmarks import tune as tune_bench

    a = {"schedule": "1F1B", "microbatches": 4, "stages_per_rank": 1, "activation_checkpointing": 0, "compile": False}
    b = {**a, "microbatches": 8}
    records = [{"machine": {"cpu": "x", "load_average": [0.1, 0.2, 0.3]}}]
    for run, (ms_a, ms_b) in enumerate([(10.0, 12.0), (11.0, 13.0), (30.0, 12.5)]):
        # warm-up step first (dropped), then the measured steps
        records += [_sweep(run, a, [99.0, ms_a, ms_a]), _sweep(run, b, [99.0, ms_b])]
        cost = {"wall_s": 0.23, "launch_s": 0.1, "cpu_s": 0.4, "trials": 2.0}
        choice = b if run == 1 else a
        records.append(
            {"case": {"kind": "tune", "workload": "mlp", "run": run}, "choice": choice, "label": "x", "cost": cost}
            | {"table": "t"}
        )
    results = tune_bench.collect(records, warmup=1)
    w = results["workloads"]["mlp"]
    assert w["best"] == a and w["candidates"] == 2
    assert w["one_sweep_s"] == pytest.approx((11.0 + 12.5) / 1e3)
    assert [t["ratio"] for t in w["tunes"]] == [1.0, pytest.approx(12.5 / 11.0), 1.0]
    assert w["tunes"][0]["sweeps"] == pytest.approx(0.23 / 0.0235)
    results.update(date="d", elapsed_s=1.0)
    text = tune_bench.markdown(results, Namespace(quick=False, runs=3))
    assert text.startswith(tune_bench.BEGIN) and text.endswith(tune_bench.END)
    assert "| mlp | 2 | 1F1B M=4 v=1 (11.0) | 1F1B M=8 v=1 (12.5) |" in text
    # The noise floor: each run's own fastest, judged by the medians over runs; a candidate's slowest over fastest run.
    assert [(p["label"], p["ratio"]) for p in w["sweep_picks"]] == [
        ("1F1B M=4 v=1", 1.0),
        ("1F1B M=4 v=1", 1.0),
        ("1F1B M=8 v=1", pytest.approx(12.5 / 11.0)),
    ]
    assert w["run_spread"] == pytest.approx((30.0 / 10.0 + 13.0 / 12.0) / 2)
    assert "| mlp | 1F1B M=4 v=1 (1.000); 1F1B M=4 v=1 (1.000); 1F1B M=8 v=1 (1.136) | 2.042 |" in text
    # The busy warning reads the load as the run started, not at its end (which counts the worker's own threads).
    assert "shared with other jobs" not in text
    results["load_end"] = [3.9, 3.6, 3.5]
    assert "shared with other jobs" not in tune_bench.markdown(results, Namespace(quick=False, runs=3))
    results["machine"].update(cpu_cores=2, load_average=[3.2, 1.0, 1.0])
    busy = tune_bench.markdown(results, Namespace(quick=False, runs=3))
    assert "shared with other jobs as this run started (load average 3.2 on 2 cores)" in busy
    assert "the processes free to use every core" in busy
    results["machine"]["pinned"] = True
    assert "each process pinned to a core of its own" in tune_bench.markdown(results, Namespace(quick=False, runs=3))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="the OS does not pin threads")
def test_the_layout_sweep_lists_every_layout_with_its_replica_batch_and_keeps_the_table_whole():
    """``tune.py --layouts``: at 2 processes, a 2-stage pipeline on the whole batch and no pipeline (DDP, FSDP) on half
    of it each, the candidates the tuner would list; a layout's label (which has a bar) stays in its table cell."""
    from benchmarks import tune as tune_bench

    args = Namespace(quick=False, layouts=True)
    found = tune_bench.sweep_candidates(args, 16, 4)
    layouts = {(s["pipeline_size"], s["data_parallel"]): b for s, b in found}
    assert layouts == {(2, "ddp"): None, (1, "ddp"): 8, (1, "fsdp"): 8}
    # No pipeline: the single-stage schedules only, microbatches dividing the replica's 8 samples, one stage.
    alone = [s for s, _ in found if s["pipeline_size"] == 1]
    assert {s["schedule"] for s in alone} == {"GPipe", "1F1B"} and {s["stages_per_rank"] for s in alone} == {1}
    assert {s["microbatches"] for s in alone} == {1, 2, 4, 8}
    assert {s["schedule"] for s, _ in found} == set(tune_bench.LAYOUT_SCHEDULES)
    assert all(not s["activation_checkpointing"] and not s["compile"] for s, _ in found)
    # Without --layouts the sweep keeps the strategy's layout and the workload's batch.
    assert {b for _, b in tune_bench.sweep_candidates(Namespace(quick=False, layouts=False), 16, 4)} == {None}
    a, b = found[0][0], next(s for s, _ in found if s["pipeline_size"] == 1)
    records = [{"machine": {"cpu": "x", "load_average": [0.1]}}]
    for run in range(2):
        records += [_sweep(run, a, [99.0, 12.0]), _sweep(run, b, [99.0, 10.0])]
        cost = {"wall_s": 1.0, "launch_s": 0.1, "cpu_s": 1.0, "trials": 2.0}
        records.append(
            {"case": {"kind": "tune", "workload": "mlp", "run": run}, "choice": b, "cost": cost}
            | {"label": tune_bench._label(b), "table": "t"}
        )
    results = tune_bench.collect(records, warmup=1) | {"date": "d", "elapsed_s": 1.0}
    text = tune_bench.markdown(results, Namespace(quick=False, runs=2, layouts=True))
    assert text.startswith(tune_bench.MARKERS[True][0]) and text.endswith(tune_bench.MARKERS[True][1])
    assert "`python benchmarks/tune.py --layouts`" in text
    assert (
        "| mlp | 2 | no pipeline ddp tp=1 \\| GPipe M=1 v=1 (10.0) | pp=2 ddp tp=1 \\| GPipe M=2 v=1 (12.0) |" in text
    )


def test_pin_to_core_pins_every_thread_of_the_process():
    # In a process of its own: the pin must not outlive the check.
    code = (
        "import os, threading, time\n"
        "from benchmarks.common import pin_to_core\n"
        "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
        "allowed = sorted(os.sched_getaffinity(0))\n"
        "core = pin_to_core(3)\n"
        "assert core == allowed[3 % len(allowed)], (core, allowed)\n"
        "tasks = os.listdir('/proc/self/task')\n"
        "assert len(tasks) >= 2 and all(os.sched_getaffinity(int(t)) == {core} for t in tasks)\n"
        "print('pinned', core)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "pinned" in proc.stdout, proc.stderr


def test_a_launch_with_more_processes_than_gpus_is_refused_before_it_starts(tmp_path, monkeypatch):
    # Found on a lent one-GPU machine: each extra rank failed with "CUDA error: invalid device ordinal".
    import torch

    from benchmarks import run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match=r"2-process launch .* cuda:1\), and torch sees 1 GPU here.*CUDA_VISIBLE"):
        run.launch(2, [{"kind": "hand"}], tmp_path, timeout=10)
    assert not list(tmp_path.iterdir())  # refused before anything was written or spawned
    run.check_devices(1)  # one process on the one GPU: accepted
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run.check_devices(8)  # no GPU: the processes share the CPUs (gloo)


def test_tune_report_of_a_stopped_worker_keeps_only_its_complete_runs(tmp_path):
    from benchmarks import tune as tune_bench

    a = {"schedule": "1F1B", "microbatches": 4, "stages_per_rank": 1, "activation_checkpointing": 0, "compile": False}
    b = {**a, "microbatches": 8}
    cases = [{"kind": "sweep", "workload": "mlp", "run": run, "settings": s} for run in (0, 1) for s in (a, b)]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    # run 0 complete (b fastest), run 1 stopped after one case (a far faster: it must not count)
    records = [{"machine": {"cpu": "x", "cpu_cores": 2}}]
    records += [_sweep(0, a, [99.0, 20.0]), _sweep(0, b, [99.0, 10.0]), _sweep(1, a, [99.0, 1.0])]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    results = tune_bench.stopped_run(tmp_path, warmup=1)
    assert results["runs"] == (1, 2) and results["elapsed_s"] is None
    assert results["workloads"]["mlp"]["best"] == b
    text = tune_bench.markdown(results, Namespace(quick=False, runs=2))
    assert "The worker was stopped after 1 of 2 runs" in text and "duration not recorded" in text


@pytest.mark.extended
@pytest.mark.slow
def test_tune_quick_run(tmp_path):
    """The smoke of benchmarks/tune.py: every workload's sweep and tuner once on tiny models, the docs left alone."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "tune.py"), "--quick", "--no-compile", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert set(results["workloads"]) == {"mlp", "gpt", "gpt-vocab"}
    for w in results["workloads"].values():
        assert w["candidates"] == 4 and len(w["tunes"]) == 1 and w["tunes"][0]["ratio"] is not None
    assert "### Results" in proc.stdout and "tuner" in proc.stdout


def test_tune_report_merges_batches_as_further_runs(tmp_path):
    from benchmarks import tune as tune_bench

    a = {"schedule": "1F1B", "microbatches": 4, "stages_per_rank": 1, "activation_checkpointing": 0, "compile": False}
    b = {**a, "microbatches": 8}
    cost = {"wall_s": 0.2, "launch_s": 0.1, "cpu_s": 0.4, "trials": 2.0}
    outputs = []
    for name, times, date in (("first", [(10.0, 12.0), (11.0, 13.0)], "d1"), ("second", [(14.0, 12.0)], "d2")):
        records = [{"machine": {"cpu": name, "load_average": [0.1, 0.2, 0.3]}}]
        for run, (ms_a, ms_b) in enumerate(times):
            records += [_sweep(run, a, [99.0, ms_a]), _sweep(run, b, [99.0, ms_b])]
            records.append({"case": {"kind": "tune", "workload": "mlp", "run": run}, "choice": b, "label": "x"})
            records[-1].update(cost=cost, table="t")
        out = tmp_path / name
        out.mkdir()
        (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (out / "results.json").write_text(json.dumps({"date": date, "elapsed_s": 5.0, "load_end": [len(times)] * 3}))
        outputs.append(out)
    results = tune_bench.merged(outputs, warmup=1)
    w = results["workloads"]["mlp"]
    # Three runs: a over them 10, 11, 14 (median 11); b 12, 13, 12 (median 12): a is best, the choice b at 12/11.
    assert [p["run"] for p in w["sweep_picks"]] == [0, 1, 2]
    assert [p["label"] for p in w["sweep_picks"]] == ["1F1B M=4 v=1", "1F1B M=4 v=1", "1F1B M=8 v=1"]
    assert [t["run"] for t in w["tunes"]] == [0, 1, 2] and w["tunes"][0]["ratio"] == pytest.approx(12.0 / 11.0)
    assert results["machine"]["cpu"] == "first" and results["load_end"] == [1, 1, 1] and results["elapsed_s"] == 10.0
    text = tune_bench.markdown(results, Namespace(quick=False, runs=3))
    assert "3 runs in 2 batches (2 runs ending d1, 1 run ending d2), interleaved within each batch" in text


# ------------------------------------------------------------------------------------------ benchmarks/alternatives.py
def test_alternatives_table_reads_every_run_and_records_refusals():
    from benchmarks import alternatives

    ok = {
        "step_s": 0.2,
        "cpu_s": [0.05, 0.07],
        "peak_rss": [300 << 20, 310 << 20],
        "state": [2 << 20, 3 << 20],
        "written_per_step": [1 << 20, 2 << 20],
        "chosen": None,
        "layout": "pp=2 dp=1 ddp 1F1B M=auto",
    }
    results = {
        "configs": {
            "gpt/2/pipeline": [ok, {**ok, "step_s": 0.4}, {**ok, "step_s": 0.1}],
            "gpt/2/fsdp": [{"error": "ValueError: The strategy `fsdp` requires a GPU accelerator"}],
        }
    }
    text = alternatives.markdown(results)
    assert "| gpt | 2 | pipeline | 200.0 (100.0-400.0) | 120.0 | 310.00 MiB | 3.00 MiB | 2.00 MiB |" in text
    assert "| gpt | 2 | fsdp | refused or failed: ValueError: The strategy `fsdp` requires a GPU" in text
    stderr = "Traceback\n  File x\n[rank0]: ValueError: bad size\nlightning.MisconfigurationException: no GPU\n\n"
    assert alternatives.last_error(stderr) == "lightning.MisconfigurationException: no GPU"
    assert alternatives.last_error("[rank1]: RuntimeError: gloo\nshutting down\n") == "[rank1]: RuntimeError: gloo"
    assert alternatives.replicas("ddp", 4) == 4 and alternatives.replicas("fsdp2-tp", 4) == 2
    assert alternatives.replicas("pipeline-fsdp", 2) == 2 and alternatives.replicas("pipeline", 4) == 1


@pytest.mark.extended
@pytest.mark.slow
def test_alternatives_smoke(tmp_path):
    """benchmarks/alternatives.py on the tiny Llama: DDP, FSDP's refusal, FSDP2, the pipeline; tables written. (The
    tuned pipeline on the Llama stops in the tuner: a known bug, docs/benchmarks.md "Pipeline or FSDP?".)"""
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "alternatives.py"), "--models", "llama", "--out", str(out)]
    cmd += ["--configs", "ddp,fsdp,fsdp2,pipeline", "--steps", "2", "--warmup", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "alternatives.json").read_text())["configs"]
    assert "requires a GPU accelerator" in results["llama/2/fsdp"][0]["error"]
    for config in ("ddp", "fsdp2", "pipeline"):
        (run,) = results[f"llama/2/{config}"]
        assert run["step_s"] > 0 and len(run["peak_rss"]) == 2 and all(s > 0 for s in run["state"]), config
    # FSDP2 holds about half of DDP's state per rank; the pipeline's layout is named
    assert max(results["llama/2/fsdp2"][0]["state"]) < 0.6 * max(results["llama/2/ddp"][0]["state"])
    assert results["llama/2/pipeline"][0]["layout"].startswith("pp=2 dp=1 ddp 1F1B")
    assert "| llama | 2 | ddp |" in (out / "alternatives.md").read_text()


# ---------------------------------------------------------------------------------------------------- phases
def test_every_phase_entry_point_exists_and_is_restored():
    """benchmarks/phases.py times functions of torch, Lightning and the strategy by name: each must exist in the
    installed versions (a renamed one would leave its phase silently empty), and each is put back afterwards."""
    import importlib

    from benchmarks import phases

    def resolve(module, qualname):
        owner = importlib.import_module(module)
        *path, attr = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner.__dict__[attr]

    before = [resolve(m, q) for m, q, _ in phases.PHASES]
    with phases.timed_phases(phases.PhaseTimer()):
        during = [resolve(m, q) for m, q, _ in phases.PHASES]
    assert all(a is not b for a, b in zip(before, during))
    assert [resolve(m, q) for m, q, _ in phases.PHASES] == before


def test_phase_timer_charges_nested_calls_to_the_inner_phase():
    import time

    from benchmarks.phases import LOOP, THREADS, PhaseTimer

    def busy(ms):
        end = time.thread_time_ns() + ms * 1_000_000
        while time.thread_time_ns() < end:
            pass

    timer = PhaseTimer()
    inner = timer.wrap(lambda: busy(20), "inner")
    outer = timer.wrap(lambda: (busy(10), inner()), "outer")
    timer.tick()
    outer()
    busy(5)
    timer.tick()
    (step,) = timer.steps
    assert 20e6 <= step["inner"] < 30e6 and 10e6 <= step["outer"] < 20e6  # the outer's own time only
    # no other thread here: the process's CPU time beyond this thread's is the two clocks' granularity
    assert 5e6 <= step[LOOP] < 15e6 and abs(step[THREADS]) < 2e6
    assert sum(v for k, v in step.items() if k != THREADS) >= 35e6


def test_phase_summary_pairs_the_rounds():
    from benchmarks.phases import LOOP, phase_names, ratio_markdown, summarize

    records = [{"machine": {"cpu": "x"}, "world_size": 2}]
    for run, (hand, strategy) in enumerate([(4.0, 5.0), (6.0, 8.0), (5.0, 6.0)]):
        for of, ms in (("hand", hand), ("strategy", strategy)):
            case = {"suite": "phases", "kind": "phases", "of": of, "run": run}
            records.append({"case": {**case, "phased": False}, "ms": [ms, ms], "cpu_ms": [2 * ms], "load": 1.0})
            steps = [{k: 0.0 for k in phase_names()} | {LOOP: ms}] * 3
            records.append({"case": {**case, "phased": True}, "ms": [ms], "cpu_ms": [ms], "phases": steps})
    out = summarize(records)
    assert out["rounds"] == 3 and out["hand_wall"]["mean"] == pytest.approx(5.0)
    # differences 1, 2, 1: mean 4/3, t(2) = 4.303, sd 0.577
    assert out["diff_wall"]["mean"] == pytest.approx(4 / 3)
    assert out["diff_wall"]["high"] - out["diff_wall"]["mean"] == pytest.approx(4.303 * 0.57735 / 3**0.5, rel=1e-3)
    assert out["diff_cpu"]["mean"] == pytest.approx(8 / 3)
    (loop,) = [row for row in out["table"] if row["phase"] == LOOP]
    assert loop["diff"]["mean"] == pytest.approx(4 / 3) and loop["hand"]["mean"] == pytest.approx(5.0)
    # ratios 5/4, 8/6, 6/5 paired round by round (not a ratio of the means)
    assert out["ratio_wall"]["mean"] == pytest.approx((5 / 4 + 8 / 6 + 6 / 5) / 3)
    # outside the stages' forward and backward: here all of the loop phase
    assert out["outside"]["diff"]["mean"] == pytest.approx(4 / 3)
    assert out["outside"]["share"]["mean"] == pytest.approx((1 / 4 + 2 / 6 + 1 / 5) / 3)
    # the --model compute block reads the same summary: ratios 1.2-1.33 (sd 0.067), interval [1.094, 1.428], above 1.02
    text = ratio_markdown(out, 2, 1, 8)
    assert "| 1.261 [1.094, 1.428] |" in text and "not met: the whole interval is above 1.02 (lower end 1.094)" in text
    assert "the strategy adds 1.33 [-0.10, 2.77] ms of CPU per step" in text


def test_compute_ratio_verdict_reads_the_interval():
    from benchmarks.phases import verdict

    assert verdict({"mean": 1.01, "low": 1.0, "high": 1.019, "n": 9}).startswith("met")
    assert verdict({"mean": 1.05, "low": 1.021, "high": 1.08, "n": 9}).startswith("not met")
    assert verdict({"mean": 1.01, "low": 0.99, "high": 1.04, "n": 9}).startswith("not established: the interval")
    assert verdict({"mean": 1.01, "low": float("nan"), "high": float("nan"), "n": 1}).startswith("not established")
    # the fixed cost's verdict reads a difference in ms against 1.5
    ms = {"mean": 1.8, "low": 1.6, "high": 2.0, "n": 9}
    assert verdict(ms, 1.5, " ms") == "not met: the whole interval is above 1.5 ms (lower end 1.600 ms)."


def test_run_py_targets_follow_the_interval_not_a_median_on_one_side():
    """`run.py`'s target line said "met" for a median of 1.010 whose runs' interval was [0.761, 1.159]."""
    from benchmarks.report import _met

    wide = {"mean": 0.96, "low": 0.761, "high": 1.159, "n": 5}
    said = _met(1.010, 1.02, wide, 3)
    assert said.startswith("mean over the runs 0.960; by its 95% confidence interval, not established")
    assert "[0.761, 1.159] contains 1.02" in said and " met" not in said
    fixed = _met(2.72, 1.5, {"mean": 2.29, "low": 0.741, "high": 3.837, "n": 5}, 2, " ms")
    assert fixed.endswith("not established: the interval [0.741, 3.837] ms contains 1.5 ms")
    assert _met(1.3, 1.5, {"mean": 1.3, "low": 1.2, "high": 1.4, "n": 5}, 2, " ms").endswith(
        "met: the whole interval is at or below 1.5 ms (upper end 1.400 ms)"
    )
    assert _met(2.0, 1.5, {"mean": 2.0, "low": 1.7, "high": 2.3, "n": 5}, 2, " ms").endswith(
        "not met: the whole interval is above 1.5 ms (lower end 1.700 ms)"
    )
    # one run has no interval: the value alone, said so
    assert _met(1.010, 1.02, None, 3) == "met (one run, no interval)"
    assert _met(1.05, 1.02, {"mean": 1.05, "low": float("nan"), "high": float("nan"), "n": 1}, 3).startswith(
        "**not met** (one run"
    )
    assert _met(None, 1.02, wide, 3) == "not measured"


def test_alternating_rounds_pair_each_strategy_step_with_the_hand_step_before_it():
    from benchmarks.phases import LOOP, alternate_markdown, cases, phase_names, summarize

    plan = cases([0, 1], 4, 1, "small", timed=False, alternate=True)
    assert [c["of"] for c in plan] == ["interleaved", "interleaved"] and plan[1]["run"] == 1
    timed = cases([0, 1], 4, 1, "small", alternate=True)  # and the phase-timed training, order reversed in round 1
    assert [(c["of"], c["phased"], c["run"]) for c in timed][1:3] == [
        ("interleaved", True, 0),
        ("interleaved", True, 1),
    ]
    records = [{"machine": {"cpu": "x"}, "world_size": 2}]
    # round 0: pairs (10, 11), (20, 21), (10, 12): strategy - hand 1, 1, 2 (median 1); ratios 1.1, 1.05, 1.2
    # (median 1.1), though the two loops' medians (10 and 12) would give 1.2; round 1: (10, 13) thrice
    walls = [([10.0, 20.0, 10.0], [11.0, 21.0, 12.0]), ([10.0] * 3, [13.0] * 3)]
    for run, (hand, strategy) in enumerate(walls):
        case = {"suite": "phases", "kind": "phases", "of": "interleaved", "run": run, "phased": False}
        cpu = {"hand": [2 * h for h in hand], "strategy": [2 * s for s in strategy]}
        record = {"case": case, "ms": [1.0], "cpu_ms": [1.0], "load": 0.5}
        records.append(record | {"steps_ms": {"hand": hand, "strategy": strategy}, "steps_cpu_ms": cpu})
    # the phase-timed trainings: the loop phase 1 ms (hand) and 1.5 / 2.5 ms (strategy) in rounds 0 and 1, the stage
    # forward 4 ms in both loops (not counted outside the stages' compute)
    for run, strategy_loop in enumerate([1.5, 2.5]):
        case = {"suite": "phases", "kind": "phases", "of": "interleaved", "run": run, "phased": True}
        steps = {
            of: [{k: 0.0 for k in phase_names()} | {LOOP: ms, "stage forward": 4.0}] * 3
            for of, ms in (("hand", 1.0), ("strategy", strategy_loop))
        }
        records.append({"case": case, "ms": [1.0], "cpu_ms": [1.0], "phases": steps})
    out = summarize(records)
    alt = out["alternating"]
    (loop,) = [row for row in alt["table"] if row["phase"] == LOOP]
    assert loop["diff"]["mean"] == pytest.approx(1.0) and loop["strategy"]["mean"] == pytest.approx(2.0)
    assert alt["outside"]["diff"]["mean"] == pytest.approx(1.0) and alt["phased_rounds"] == 2
    assert alt["outside"]["share"]["mean"] == pytest.approx(1.0 / 5.0)  # 0.5 and 1.5 over the hand step's 5 ms
    assert alt["rounds"] == 2 and out["load"] == [0.5, 0.5] and alt["steps"] == 3 and "table" not in out
    assert alt["diff_wall"]["mean"] == pytest.approx(2.0)  # medians 1 and 3
    assert alt["diff_cpu"]["mean"] == pytest.approx(4.0)
    assert alt["ratio_wall"]["mean"] == pytest.approx((1.1 + 1.3) / 2)
    # t(1) = 12.706, sd of (1, 3) = 1.414: the interval 2 +- 12.706
    assert alt["diff_wall"]["high"] == pytest.approx(2.0 + 12.706 * 2**0.5 / 2**0.5, rel=1e-4)
    assert alt["hand_wall"]["mean"] == pytest.approx(10.0) and alt["strategy_wall"]["mean"] == pytest.approx(12.5)
    # within-round spread: round 0's ratios (1.1, 1.05, 1.2) have sd 0.0764, round 1's none
    assert alt["spread"] == pytest.approx((0.076376 + 0.0) / 2, rel=1e-4)
    text = alternate_markdown(out, "small", 1, 4)
    assert "| wall time, ms | 10.00 [10.00, 10.00] | 12.50 [6.15, 18.85] | 2.00 [-10.71, 14.71] | 1.200" in text
    assert (
        "Target (fixed cost at most 1.5 ms): not established: the interval [-10.706, 14.706] ms contains 1.5 ms."
        in text
    )
    assert "varies by 3.8% (standard deviation)" in text and "2 rounds, each one strategy training of 3" in text
    assert text.startswith("<!-- benchmarks/phases.py --model small --alternate: begin")
    assert "| loop and hooks | 1.00 [1.00, 1.00] | 2.00 [-4.35, 8.35] | 1.00 [-5.35, 7.35] |" in text
    assert "2 more rounds, every phase timed" in text
    # --floor: Lightning's loop driving the hand loop in place of the strategy, summarized and written on its own
    floor_plan = cases([0], 4, 1, "small", timed=False, alternate=True, floor=True)
    assert [(c["of"], c.get("floor")) for c in floor_plan] == [("interleaved", True)]
    assert "floor" not in cases([0], 4, 1, "small", alternate=True)[0]
    floored = [records[0], *({**r, "case": {**r["case"], "floor": True}} for r in records[1:])]
    assert "alternating" not in summarize(floored) and summarize(floored)["floor"]["diff_wall"] == alt["diff_wall"]
    both = summarize([*records, *floored[1:]])
    assert both["alternating"]["rounds"] == 2 and both["floor"]["rounds"] == 2
    text = alternate_markdown(summarize(floored), "small", 1, 4, floor=True)
    assert text.startswith("<!-- benchmarks/phases.py --model small --alternate --floor: begin")
    assert "| wall time, ms | 10.00 [10.00, 10.00] | 12.50 [6.15, 18.85] | 2.00 [-10.71, 14.71] | 1.200" in text
    assert "Lightning's share of the strategy's fixed cost: 2.00 [-10.71, 14.71] ms of wall clock" in text
    assert "| phase | hand-written loop | Lightning + hand | Lightning + hand - hand |" in text
    assert "Target" not in text and "Outside the stages' forward and backward Lightning adds 1.00" in text
    compute = alternate_markdown(summarize(floored), "compute", 1, 8, floor=True)
    assert "Lightning's share of the compute-bound ratio: 1.200 [-0.071, 2.471] of wall clock" in compute
    assert "(2.00 [-10.71, 14.71] ms per step); the rest of the strategy's ratio is its own." in compute


def test_lightning_driving_the_hand_loop_trains_exactly_as_the_hand_loop(tmp_path):
    """The --floor measurement's training (benchmarks/lit.py HandModule) does the hand loop's work at every step, no
    more and no less: Lightning's zero_grad, the schedule in backward and Lightning's optimizer step give the bare
    hand loop's losses and weights, bit for bit (one process, the same op sequence)."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    from benchmarks import hand, lit
    from benchmarks.common import MODELS, dataset

    spec, steps = MODELS["tiny"], 3
    owned = not dist.is_initialized()  # an earlier one-process test may have left its group up
    if owned:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        module = lit.HandModule(spec, "1F1B", 4, spec.batch, steps)
        # On the CPU, as the bare loop below (with CUDA visible the benchmark Trainer would take the GPU).
        lit.trainer(lit.unwrapped_ddp(), 1, steps, [], accelerator="cpu").fit(module)
        bare = hand.HandPipeline(spec, "1F1B", 4, 0, 1, torch.device("cpu"))
        initial = [p.detach().clone() for p in bare.optimizer.param_groups[0]["params"]]
        # Lightning's DistributedSampler shuffles training data (seed 0, epoch 0) even for one replica: replay it
        data = dataset(spec, steps)
        order = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        for inputs, targets in DataLoader(data, batch_size=spec.batch, sampler=order, drop_last=True):
            bare.step(inputs, targets)
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()
    assert len(bare.history) == steps and module.pipeline.history == bare.history
    floor = module.pipeline.optimizer.param_groups[0]["params"]
    trained = bare.optimizer.param_groups[0]["params"]
    assert all(torch.equal(a, b) for a, b in zip(floor, trained)) and len(floor) == len(trained) == 2 * spec.depth
    assert not any(torch.equal(a, b) for a, b in zip(trained, initial))  # the optimizer stepped


def test_the_floor_needs_the_alternating_loops(capsys):
    from benchmarks.phases import main

    with pytest.raises(SystemExit) as raised:
        main(["--floor"])
    assert raised.value.code == 2
    assert "--floor measures Lightning's share by alternating the loops step by step: add --alternate" in (
        capsys.readouterr().err
    )


def test_the_tune_report_reads_the_cost_models_first_trial_error_and_the_tuners_sureness(tmp_path):
    import pickle

    from benchmarks import tune as tune_bench
    from lightning_pipe.tune.cost import BalanceRule, Trial, calibrate, predict
    from lightning_pipe.tune.space import Candidate
    from tests.test_tune import _profile

    profile, rule = _profile(), BalanceRule("blocks")
    first, other = Candidate("1F1B", 4, 1), Candidate("GPipe", 2, 1)
    trials = [Trial(first, 0.05), Trial(other, 0.5)]  # the second trial must not move the first-trial model
    (tmp_path / "tune-mlp-0.model.pkl").write_bytes(pickle.dumps((profile, rule, 2, trials, (0.0, 0.0), (0.0, 0.0))))
    sure = {"rival": first.label, "ratio": 1.2, "interval": [1.1, 1.3], "probability": 0.99, "within_noise": False}
    records = [{"machine": {"cpu": "x"}}, _sweep(0, other.settings(), [99.0, 40.0])]
    records.append(
        {"case": {"kind": "tune", "workload": "mlp", "run": 0}, "choice": other.settings(), "label": other.label}
        | {"cost": {"wall_s": 1.0, "launch_s": 0.1, "cpu_s": 1.0, "trials": 2.0}, "table": "t", "sureness": sure}
    )
    results = tune_bench.collect(records, warmup=1, files=tmp_path) | {"date": "d", "elapsed_s": 1.0}
    expected = predict(other, profile, rule, 2, calibrate(profile, rule, 2, trials[:1])).step * 1e3 / 40.0
    assert results["workloads"]["mlp"]["model"] == [{"run": 0, "label": other.label, "ratio": expected}]
    text = tune_bench.markdown(results, Namespace(quick=False, runs=1))
    assert f"| mlp | {expected:.2f} ({expected:.2f}-{expected:.2f}) | {other.label}: {expected:.2f} |" in text
    assert f"| mlp | 0 | {first.label} | 1.200 [1.100, 1.300] | 0.99 |" in text


def test_a_layout_run_of_other_workloads_has_a_section_of_its_own():
    from benchmarks import tune as tune_bench

    default = Namespace(quick=False, layouts=True, workloads=["small", "gpt", "gpt-vocab"])
    assert tune_bench.markers(default) == tune_bench.MARKERS[True]
    assert tune_bench.markers(Namespace(quick=False, layouts=False, workloads=["wide"])) == tune_bench.MARKERS[False]
    other = Namespace(quick=False, layouts=True, workloads=["wide", "deep"], schedules=["1F1B"], microbatches=[1, 2])
    begin, end = tune_bench.markers(other)
    assert "--layouts --workloads wide deep --schedules 1F1B --microbatches 1 2: begin" in begin
    assert end.endswith("--microbatches 1 2: end -->") and begin not in tune_bench.MARKERS[True]


def test_the_per_microbatch_slopes_are_paired_round_by_round():
    from benchmarks import microbatches

    def record(run: int, m: int, hand: float, strategy: float) -> dict:
        steps = {"hand": [hand, hand], "strategy": [strategy, strategy]}
        return {"case": {"suite": "microbatches", "run": run, "microbatches": m}, "steps_ms": steps, "load": 1.0}

    # hand: 2 + 1 ms per microbatch; strategy: 3 + 1.5 (round 0) and 3 + 1.25 (round 1) ms per microbatch
    records = [{"machine": {"cpu": "x"}}]
    for run, per in ((0, 1.5), (1, 1.25)):
        records += [record(run, m, 2 + m, 3 + per * m) for m in microbatches.COUNTS]
    records.append(record(2, 1, 1.0, 1.0))  # an incomplete round: left out
    summary = microbatches.summarize(records)
    assert summary["rounds"] == 2
    assert summary["slope"]["hand"]["mean"] == pytest.approx(1.0)
    assert summary["slope"]["diff"]["mean"] == pytest.approx(0.375)
    assert summary["per_count"]["16"]["diff"]["mean"] == pytest.approx((27.0 + 23.0) / 2 - 18)
    text = microbatches.markdown(summary, 80, 10)
    assert text.startswith(microbatches.BEGIN) and text.endswith(microbatches.END)
    assert "**strategy - hand 0.375 [" in text


def test_step_calls_counts_one_more_microbatch_per_rank_and_names_what_differs():
    from benchmarks import step_calls

    # calls per step at 1 and 16 microbatches: the hand loop's `f` 10 a microbatch; the strategy's `f` the same, and
    # its `g` 2 a microbatch more, `h` a fixed cost of 5 a step (not per microbatch, so not in the difference)
    f, g, h, x = "torch/nn/modules/module.py:1(f)", "lightning_pipe/step/stage.py:2(g)", "a.py:3(h)", "~:0(<len>)"
    rank = {
        "hand": {"1": {f: 10.0, x: 3.0}, "16": {f: 160.0, x: 3.0}},
        "strategy": {"1": {f: 10.0, g: 2.0, h: 5.0}, "16": {f: 160.0, g: 32.0, h: 5.0}},
    }
    # Lightning's loop driving the hand loop (the floor), counted at 1 microbatch only: 4 calls more a step than the
    # hand loop's 13, the strategy's 17 a step thus 0 over the floor on this rank and 3 over it on the other
    floor = {"floor": {"1": {f: 10.0, x: 3.0, "lightning/loop.py:9(run)": 4.0}}}
    other = {**rank, "floor": {"1": {f: 10.0, x: 4.0}}}
    summary = step_calls.summarize([{**rank, **floor}, other])
    first = summary["ranks"][0]
    assert (first["hand"], first["strategy"], first["diff"]) == (10.0, 12.0, 2.0)
    assert first["most"] == [(g, 2.0)]
    assert first["step"] == {"hand": 13.0, "floor": 17.0, "strategy": 17.0}
    text = step_calls.markdown(summary, "this tree")
    assert text.startswith(step_calls.BEGIN) and text.endswith(step_calls.END)
    assert "| 1 | 10 | 12 | +2 | `step/stage.py:g` +2 |" in text
    assert "| 0 | 13 | 17 | 17 | +0 |" in text and "| 1 | 13 | 14 | 17 | +3 |" in text
    # a record from before the floor was counted gives the first table alone
    assert "floor" not in step_calls.markdown(step_calls.summarize([rank, rank]), "this tree")
