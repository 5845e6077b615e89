"""``PipelineTimeline``: where the time of a pipelined training step goes, on every rank.

Add it to the Trainer's callbacks; it is off unless added. Each rank records when each forward, backward,
weight-gradient and loss action of its stages ran, and its point-to-point operations
(:mod:`lightning_pipe.measure.timeline`). At the end of training the pipeline's first rank writes

- ``timeline.json``: a Chrome-trace/Perfetto file (open it in https://ui.perfetto.dev or ``chrome://tracing``) with
  one track per rank, of the ``trace_steps`` steps after the first ``skip_steps``;
- ``timeline.png``: a Gantt chart of one of them (the one whose bubble is the median), one row per rank, the
  microbatch number in each box, idle time left empty;

and every ``log_every_n_steps`` steps the loggers receive ``pipeline/bubble`` (the measured idle fraction of the
steps since the last report) beside ``pipeline/bubble_theory`` (see
:func:`lightning_pipe.measure.timeline.theoretical_bubble`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_pipe.comm import collectives
from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.measure.simulate import BubbleGap, explain_bubble
from lightning_pipe.measure.timeline import (
    COMPUTE,
    Event,
    StepSummary,
    TimelineRecorder,
    action_durations,
    bubble_fraction,
    chrome_trace,
    summarize,
    theoretical_bubble,
)
from lightning_pipe.schedules.custom import CustomSchedule

# A child of Lightning's logger: its lines appear wherever Lightning's own INFO lines do.
log = logging.getLogger("lightning.pytorch.lightning_pipe")


def _check_count(name: str, value: Any, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PipelineConfigError(
            "PipelineTimeline counts steps with ints >= 0 (`log_every_n_steps` also takes None), got"
            f" `{name}={value!r}`. Pass 0 or a positive int."
        )


class PipelineTimeline(pl.Callback):
    """Records a timeline of every rank of the pipeline; writes a Chrome trace and a Gantt chart, logs the bubble.

    Arguments:
        dirpath: Where ``timeline.json`` and ``timeline.png`` go. ``None``: ``<trainer.log_dir>/timeline`` (the
            Trainer's ``default_root_dir`` without a logger).
        trace_steps: Training steps written to the trace (the chart shows one of them). ``0``: no files.
        skip_steps: First training steps neither traced nor counted in the logged bubble (the first step also runs
            torch's shape inference).
        log_every_n_steps: Log ``pipeline/bubble`` and ``pipeline/bubble_theory`` to the loggers every this many
            steps (one small collective each time). ``None``: the Trainer's ``log_every_n_steps``; ``0``: never.
        chart: Write ``timeline.png`` (needs matplotlib: ``pip install "lightning-pipe[plots]"``).

    Recording costs two clock readings per schedule action; a Trainer without this callback measures nothing.
    """

    def __init__(
        self,
        dirpath: Optional[Union[str, Path]] = None,
        trace_steps: int = 3,
        skip_steps: int = 1,
        log_every_n_steps: Optional[int] = None,
        chart: bool = True,
    ) -> None:
        _check_count("trace_steps", trace_steps)
        _check_count("skip_steps", skip_steps)
        _check_count("log_every_n_steps", log_every_n_steps, allow_none=True)
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.trace_steps = trace_steps
        self.skip_steps = skip_steps
        self.log_every_n_steps = log_every_n_steps
        self.chart = chart
        #: measured bubble of every counted step (by step number, from 0), the same on every rank of a pipeline
        self.bubbles: dict[int, float] = {}
        #: the theoretical bubble of the last counted step
        self.theory: float | None = None
        #: the files written at the end of training (on the rank that writes them)
        self.files: list[Path] = []
        #: the traced steps' median bubble taken apart (theory, the schedule, the last stage's loss, stage imbalance,
        #: communication and other; :func:`lightning_pipe.measure.simulate.explain_bubble`), on the rank that writes
        #: the files
        self.explanation: BubbleGap | None = None
        self._recorder: TimelineRecorder | None = None
        self._strategy: Any = None
        self._step = 0
        self._pending: list[tuple[int, int, int, int, int]] = []  # (step, first, last, busy, microbatches)
        self._traced: list[Event] = []

    # ------------------------------------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # By the registered name, not the class: callbacks sit below the strategy in the package's layers.
        if getattr(trainer.strategy, "strategy_name", None) != "pipeline":
            raise PipelineConfigError(
                f"PipelineTimeline records pipeline schedules, but the Trainer's strategy is"
                f" {type(trainer.strategy).__name__}. Use `Trainer(strategy='pipeline')` (PipelineParallelStrategy),"
                " or remove the PipelineTimeline callback."
            )
        if self.chart and self.trace_steps:
            _require_matplotlib()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        self._strategy = strategy
        # One time axis for all ranks: each takes its origin right after the same barrier.
        collectives.barrier(strategy.pipeline_group)
        self._recorder = TimelineRecorder()
        self._step, self._pending, self._traced = 0, [], []
        strategy.runtime.attach_timeline(self._recorder)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._recorder is not None:
            self._recorder.step = self._step if self._step >= self.skip_steps else None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        recorder = self._recorder
        if recorder is None:
            return
        step, self._step = self._step, self._step + 1
        recorder.step = None
        events = recorder.take()
        if step < self.skip_steps:
            return
        summary = summarize(events).get(step) or StepSummary(step, 0, 0, 0)
        microbatches = len({e.microbatch for e in events if e.kind == "F"})
        self._pending.append((step, summary.first, summary.last, summary.busy, microbatches))
        if step < self.skip_steps + self.trace_steps:
            self._traced.extend(events)
        every = trainer.log_every_n_steps if self.log_every_n_steps is None else self.log_every_n_steps
        if every and len(self._pending) >= every:
            self._report(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._recorder is None:
            return
        if self._pending:
            self._report(trainer, log=bool(self.log_every_n_steps != 0))
        self._strategy.runtime.attach_timeline(None)
        self._recorder = None
        if self.trace_steps:
            self._write(trainer)

    # ------------------------------------------------------------------------------------------------ reports
    def _group(self) -> Any:
        strategy = self._strategy
        return strategy.pipeline_group

    def _report(self, trainer: pl.Trainer, log: bool = True) -> None:
        """Gather the pending step summaries of every rank of the pipeline; record and log their bubbles."""
        mine = torch.tensor(self._pending, dtype=torch.int64)
        everyone = collectives.all_gather(mine, self._group())
        self._pending = []
        bubbles = []
        for row in range(mine.shape[0]):
            per_rank = [summary_row(t[row]) for t in everyone]
            step = int(mine[row, 0])
            if any(s is None for s in per_rank):
                continue
            self.bubbles[step] = bubble_fraction(per_rank)  # type: ignore[arg-type]
            bubbles.append(self.bubbles[step])
            microbatches = max(int(t[row, 4]) for t in everyone)
            strategy = self._strategy
            self.theory = theoretical_bubble(strategy.pipeline_size, microbatches, strategy.stages_per_rank)
        if log and bubbles and trainer.is_global_zero:
            metrics = {"pipeline/bubble": statistics.fmean(bubbles), "pipeline/bubble_theory": self.theory}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _write(self, trainer: pl.Trainer) -> None:
        strategy = self._strategy
        # On every rank: `trainer.log_dir` is a collective.
        dirpath = self.dirpath or Path(trainer.log_dir or trainer.default_root_dir) / "timeline"
        events = [tuple(e) for e in self._traced]
        gathered = collectives.all_gather_object(events, self._group(), strategy.root_device)
        self._traced = []
        if not trainer.is_global_zero:
            return
        per_rank = [[Event(*e) for e in rank_events] for rank_events in gathered]
        dirpath.mkdir(parents=True, exist_ok=True)
        steps = sorted({e.step for events in per_rank for e in events})
        metadata = {
            "schedule": strategy.schedule_name,
            "pipeline_size": strategy.pipeline_size,
            "stages_per_rank": strategy.stages_per_rank,
            "steps": steps,
            "bubble": {str(s): self.bubbles.get(s) for s in steps},
            "bubble_theory": self.theory,
            "time_unit": "us since the recording's origin (the same instant on every rank)",
        }
        self.explanation = explain(strategy, per_rank, [self.bubbles[s] for s in steps if s in self.bubbles])
        if self.explanation is not None:
            metadata["bubble_explained"] = dataclasses.asdict(self.explanation)
            log.info(f"PipelineTimeline: {self.explanation.describe()}")
        trace_file = dirpath / "timeline.json"
        trace_file.write_text(json.dumps(chrome_trace(per_rank, metadata)))
        self.files = [trace_file]
        if self.chart and steps:
            known = [s for s in steps if s in self.bubbles] or steps
            step = sorted(known, key=lambda s: self.bubbles.get(s, 0.0))[len(known) // 2]
            chart_file = dirpath / "timeline.png"
            title = gantt_title(strategy.schedule_name, per_rank, step, self.bubbles.get(step), self.theory)
            draw_gantt([[e for e in events if e.step == step] for events in per_rank], chart_file, title)
            self.files.append(chart_file)


def explain(strategy: Any, per_rank: list[list[Event]], bubbles: list[float]) -> BubbleGap | None:
    """The traced steps' median bubble taken apart, from their median action times (``None`` without steps)."""
    events = [e for events in per_rank for e in events]
    microbatches = len({e.microbatch for e in events if e.kind == "F" and e.stage == 0})
    if not bubbles or not microbatches:
        return None
    stage_rank = {e.stage: rank for rank, events in enumerate(per_rank) for e in events}
    stages = strategy.pipeline_size * strategy.stages_per_rank
    if sorted(stage_rank) != list(range(stages)):
        return None  # a stage recorded nothing in the traced steps: nothing to take apart
    schedule = strategy.settings.schedule
    return explain_bubble(
        action_durations(events),
        statistics.median(bubbles),
        [[tuple(a) for a in rank] for rank in schedule.actions] if isinstance(schedule, CustomSchedule) else schedule,
        strategy.pipeline_size,
        microbatches,
        strategy.stages_per_rank,
        [stage_rank[s] for s in range(stages)],
    )


def summary_row(row: torch.Tensor) -> StepSummary | None:
    """A gathered ``(step, first, last, busy, microbatches)`` row; ``None`` when the rank ran no action."""
    step, first, last, busy = (int(v) for v in row[:4])
    return None if last <= first and busy == 0 else StepSummary(step, first, last, busy)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "PipelineTimeline(chart=True) draws timeline.png with matplotlib, which is not installed. Install it"
            ' (`pip install "lightning-pipe[plots]"`) or pass `chart=False` to keep only the trace.'
        ) from err


# ---------------------------------------------------------------------------------------------------- the chart
COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#8172B3", "L": "#DD8452"}


def gantt_title(
    schedule: str, per_rank: list[list[Event]], step: int, bubble: float | None, theory: float | None
) -> str:
    events = [e for events in per_rank for e in events if e.step == step and e.kind in COMPUTE]
    microbatches = len({e.microbatch for e in events if e.kind == "F"})
    span = (max(e.end for e in events) - min(e.start for e in events)) / 1e6 if events else 0.0
    parts = [f"{schedule}, {len(per_rank)} ranks, {microbatches} microbatches: step {step}, {span:.1f} ms"]
    if bubble is not None:
        parts.append(f"bubble {bubble:.0%} measured" + (f", {theory:.0%} in theory" if theory is not None else ""))
    return "; ".join(parts)


def draw_gantt(per_rank: list[list[Event]], path: Path, title: str = "") -> None:
    """One step as a Gantt chart: a row per rank, a box per compute action with its microbatch number, idle time
    empty (like the schedule figures of the pipeline papers). Stages after a rank's first are drawn lighter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    compute = [[e for e in events if e.kind in COMPUTE] for events in per_rank]
    starts = [e.start for events in compute for e in events]
    origin = min(starts) if starts else 0
    span = max((e.end for events in compute for e in events), default=origin + 1) - origin
    fig, ax = plt.subplots(figsize=(12, 1.4 + 0.5 * len(per_rank)))
    for rank, events in enumerate(compute):
        first_stage = min((e.stage for e in events), default=0)
        for e in events:
            x, width = (e.start - origin) / 1e6, (e.end - e.start) / 1e6
            alpha = 1.0 if e.stage == first_stage else 0.55
            ax.barh(rank, width, left=x, height=0.8, color=COLORS[e.kind], alpha=alpha, edgecolor="white", lw=0.5)
            if e.kind != "L" and width > span / 1e6 / 90:
                ax.text(x + width / 2, rank, str(e.microbatch), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
    ax.set_ylim(len(per_rank) - 0.5, -0.5)
    ax.set_xlim(0, span / 1e6)
    ax.set_xlabel("ms since the step's first action")
    kinds = [k for k in COMPUTE if any(e.kind == k for events in compute for e in events)]
    names = {"F": "forward", "B": "backward", "W": "weight grad", "L": "loss (your step)"}
    handles = [Patch(color=COLORS[k], label=names[k]) for k in kinds]
    if any(len({e.stage for e in events}) > 1 for events in compute):
        handles.append(Patch(color="grey", alpha=0.45, label="paler: the rank's later stage"))
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        frameon=False,
        fontsize=8,
    )
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
