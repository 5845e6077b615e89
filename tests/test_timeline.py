"""PipelineTimeline: the recorder and the bubble arithmetic (one process), and real 2-process runs whose trace has one
track per rank with every microbatch's forward and backward, a chart, and a GPipe bubble close to theory."""

from __future__ import annotations

import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch

from lightning_pipe.callbacks import PipelineTimeline
from lightning_pipe.callbacks.timeline import draw_gantt
from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.measure.simulate import BubbleGap, explain_bubble
from lightning_pipe.measure.timeline import (
    Event,
    StepSummary,
    TimelineRecorder,
    bubble_fraction,
    chrome_trace,
    ideal_speedup,
    step_bubbles,
    summarize,
    theoretical_bubble,
)
from tests.launch import run_script

CONFIGS = [
    # The acceptance case: GPipe, 2 stages, 4 microbatches, on the compute-bound benchmark model.
    {"name": "gpipe", "schedule": "GPipe", "model": "compute", "microbatches": 4, "steps": 6},
    {"name": "1f1b", "schedule": "1F1B", "model": "small", "microbatches": 4, "steps": 4},
    {"name": "interleaved", "schedule": "Interleaved1F1B", "model": "small", "microbatches": 4, "steps": 4},
    {"name": "zbv", "schedule": "ZBVZeroBubble", "model": "small", "microbatches": 4, "steps": 4},
]
STAGES = {"gpipe": [[0], [1]], "1f1b": [[0], [1]], "interleaved": [[0, 2], [1, 3]], "zbv": [[0, 3], [1, 2]]}


# ---------------------------------------------------------------------------------------------------- one process
def test_theory():
    assert theoretical_bubble(2, 4) == pytest.approx(0.2)
    assert theoretical_bubble(4, 16) == pytest.approx(3 / 19)
    assert theoretical_bubble(2, 4, stages_per_rank=2) == pytest.approx(1 / 9)
    assert ideal_speedup(2, 4) == pytest.approx(1.6)
    assert ideal_speedup(2, 8, stages_per_rank=2) == pytest.approx(16 / 8.5)
    assert ideal_speedup(1, 8) == 1.0


def _gpipe_events(k: int, m: int, f: int = 10, b: int = 20) -> list[list[Event]]:
    """An ideal GPipe step: forwards fill the pipe, backwards drain it, no communication time."""
    per_rank = []
    for r in range(k):
        events = [Event(0, "F", r, i, (r + i) * f, (r + i + 1) * f) for i in range(m)]
        start = (m + k - 1) * f + (k - 1 - r) * b
        events += [Event(0, "B", r, i, start + i * b, start + (i + 1) * b) for i in range(m)]
        per_rank.append(events)
    return per_rank


@pytest.mark.parametrize(("k", "m"), [(2, 4), (4, 4), (4, 16)])
def test_an_ideal_gpipe_step_has_the_theoretical_bubble(k, m):
    assert step_bubbles(_gpipe_events(k, m)) == {0: pytest.approx(theoretical_bubble(k, m))}


def test_the_bubble_taken_apart():
    equal = {(s, k): t for s in (0, 1) for k, t in (("F", 1.0), ("B", 2.0))}
    gap = explain_bubble(equal, 0.25, "1F1B", 2, 4, 1, [0, 1])
    assert gap.schedule == pytest.approx(0.2) == pytest.approx(gap.theory)
    assert gap.loss == gap.imbalance == 0.0 and gap.other == pytest.approx(0.05)
    measured = {**equal, (1, "F"): 1.5, (1, "L"): 0.5}
    gap = explain_bubble(measured, 0.4, "1F1B", 2, 4, 1, [0, 1])
    assert gap.loss > 0 and gap.imbalance > 0
    assert gap.schedule + gap.loss + gap.imbalance + gap.other == pytest.approx(0.4)
    assert "+ last stage's loss" in gap.describe()
    zbv = {(s, k): t for s in range(4) for k, t in (("F", 1.0), ("B", 1.0), ("W", 1.0))}
    gap = explain_bubble(zbv, 0.1, "ZBVZeroBubble", 2, 8, 2, [0, 1, 1, 0])
    assert gap.schedule < gap.theory  # the zero-bubble schedule goes below the formula


def test_summaries_count_compute_only():
    events = [Event(3, "recv", 1, 0, 0, 50), Event(3, "F", 1, 0, 50, 60), Event(3, "send", 1, 0, 60, 60)]
    events += [Event(3, "L", 1, 0, 60, 65), Event(3, "B", 1, 0, 70, 90), Event(4, "F", 1, 0, 200, 210)]
    assert summarize(events) == {3: StepSummary(3, 50, 90, 35), 4: StepSummary(4, 200, 210, 10)}
    assert bubble_fraction([StepSummary(3, 50, 90, 35), StepSummary(3, 40, 80, 40)]) == pytest.approx(1 - 75 / 100)


def test_the_recorder_records_only_a_set_step_and_pairs_receives_with_their_action():
    recorder = TimelineRecorder(origin=0)
    recorder.posted("recv", "F", 1, 0)
    recorder.compute("F", 1, 0, recorder.now())
    assert recorder.take() == []
    recorder.step = 7
    recorder.posted("recv", "F", 1, 2)
    start = recorder.now()
    recorder.compute("F", 1, 2, start)
    recorder.posted("send", "F", 1, 2)
    events = recorder.take()
    assert [(e.step, e.kind, e.stage, e.microbatch) for e in events] == [
        (7, "recv", 1, 2),
        (7, "F", 1, 2),
        (7, "send", 1, 2),
    ]
    assert events[0].end == events[1].start == start
    assert recorder.take() == []


def test_chrome_trace_has_one_process_track_per_rank():
    trace = chrome_trace(_gpipe_events(2, 3), {"schedule": "GPipe"})
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0 (stage 0)", 1: "rank 1 (stage 1)"}
    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert len(slices) == 12 and {e["tid"] for e in slices} == {0}
    assert trace["metadata"] == {"schedule": "GPipe"}
    json.dumps(trace)


def test_gantt_chart_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    draw_gantt(_gpipe_events(2, 4), tmp_path / "g.png", "GPipe")
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "kwargs", [{"trace_steps": -1}, {"skip_steps": 1.5}, {"log_every_n_steps": -2}, {"trace_steps": True}]
)
def test_bad_arguments(kwargs):
    ((name, value),) = kwargs.items()
    with pytest.raises(PipelineConfigError, match=rf"ints >= 0 .*got `{name}={value!r}`\. Pass 0 or a positive int"):
        PipelineTimeline(**kwargs)


def test_no_step_counts_are_fine():
    timeline = PipelineTimeline(trace_steps=0, skip_steps=0, log_every_n_steps=None)
    assert (timeline.trace_steps, timeline.skip_steps, timeline.log_every_n_steps) == (0, 0, None)


def test_another_strategy_is_refused(tmp_path):
    from tests.models import LitMLP

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[PipelineTimeline()], logger=False)
    with pytest.raises(PipelineConfigError, match="PipelineTimeline records pipeline schedules, but the Trainer's"):
        trainer.fit(LitMLP())


def test_a_chart_without_matplotlib_is_refused(monkeypatch):
    from lightning_pipe.callbacks import timeline as module

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install \"lightning-pipe\[plots\]\"\`\) or pass \`chart=False\`"):
        module._require_matplotlib()


# ---------------------------------------------------------------------------------------------------- 2 processes
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("matplotlib")  # the runs draw their chart
    out = tmp_path_factory.mktemp("timeline")
    run_script("timeline.py", str(out), json.dumps(CONFIGS), nprocs=2, launcher="lightning")
    return out


def _ranks(out: Path, name: str) -> list[dict]:
    return [torch.load(out / f"{name}.rank{r}.pt") for r in (0, 1)]


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c["name"])
def test_the_trace_has_every_action_of_every_rank(runs, cfg):
    ranks = _ranks(runs, cfg["name"])
    assert [r["stages"] for r in ranks] == STAGES[cfg["name"]]
    assert all(r["detached"] for r in ranks)
    files = [Path(f) for f in ranks[0]["files"]]
    assert [f.name for f in files] == ["timeline.json", "timeline.png"] and ranks[1]["files"] == []
    expected_dir = Path(ranks[0]["log_dir"]) / "timeline" if cfg["name"] == "1f1b" else runs / cfg["name"]
    assert files[0].parent == expected_dir
    assert files[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads(files[0].read_text())
    tracks = {e["pid"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert tracks == {0, 1}
    assert trace["metadata"]["steps"] == [1, 2]
    actions = defaultdict(set)  # (rank, step, kind) -> {(stage, microbatch)}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e["tid"] == 0:
            actions[(e["pid"], e["args"]["step"], e["name"][0])].add((e["args"]["stage"], e["args"]["microbatch"]))
    m = cfg["microbatches"]
    last_stage = max(s for stages in STAGES[cfg["name"]] for s in stages)
    for rank, stages in enumerate(STAGES[cfg["name"]]):
        for step in (1, 2):
            every = {(s, i) for s in stages for i in range(m)}
            assert actions[(rank, step, "F")] == every
            assert actions[(rank, step, "B")] == every
            losses = {(last_stage, i) for i in range(m)} if last_stage in stages else set()
            assert actions[(rank, step, "L")] == losses
            if cfg["schedule"] == "ZBVZeroBubble":
                assert actions[(rank, step, "W")] == every
    p2p = [e for e in trace["traceEvents"] if e.get("tid") == 1 and e.get("ph") in ("X", "i")]
    assert {e["cat"] for e in p2p} == {"recv", "send"}
    # The bubble of every counted step went to every rank alike, and to the logger beside the theory.
    assert ranks[0]["bubbles"] == ranks[1]["bubbles"] and sorted(ranks[0]["bubbles"]) == list(range(1, cfg["steps"]))
    with open(Path(ranks[0]["log_dir"]) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("pipeline/bubble")]
    assert len(rows) >= 2 and all(0.0 <= float(r["pipeline/bubble"]) < 1.0 for r in rows)
    assert float(rows[0]["pipeline/bubble_theory"]) == pytest.approx(ranks[0]["theory"])
    # The traced steps' bubble, taken apart (rank 0 writes the files and explains).
    gap = BubbleGap(**ranks[0]["explanation"])
    assert ranks[1]["explanation"] is None and trace["metadata"]["bubble_explained"]["measured"] == gap.measured
    assert gap.schedule + gap.loss + gap.imbalance + gap.other == pytest.approx(gap.measured)
    assert gap.theory == pytest.approx(ranks[0]["theory"])
    if cfg["schedule"] in ("GPipe", "1F1B"):
        # the loss lengthens the last stage, on the critical path (under a V schedule it may fill idle time instead)
        assert gap.schedule == pytest.approx(gap.theory) and gap.loss > 0


@pytest.mark.extended
@pytest.mark.slow
def test_gpipe_bubble_is_close_to_theory(runs):
    """K=2, M=4: (K-1)/(M+K-1) = 0.2. The best of the 5 counted steps (other processes on the machine only add idle
    time) is within 0.1 of it."""
    ranks = _ranks(runs, "gpipe")
    assert ranks[0]["theory"] == pytest.approx(0.2)
    best = min(ranks[0]["bubbles"].values())
    assert abs(best - 0.2) <= 0.1, ranks[0]["bubbles"]
