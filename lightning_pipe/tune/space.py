"""What the tuner may choose: the search space, the candidates in it, and which of them can run at all.

A :class:`Candidate` is one setting of the five strategy arguments the tuner decides (``schedule``,
``microbatches``, ``stages_per_rank``, ``activation_checkpointing``, ``compile``), and, when the space searches the
layout, of three more (``pipeline_size``, ``data_parallel``, ``tensor_parallel``:
:mod:`lightning_pipe.tune.layout`); every other argument stays the user's. :func:`candidates` lists the candidates
of a :class:`SearchSpace` that can run for a given pipeline size, batch size and block count: the microbatch count
divides the batch, every stage gets a block, the schedule takes that many stages per rank and microbatches (torch's
own schedule checks decide, through :func:`lightning_pipe.measure.simulate.schedule_orders`), ``compile`` is not
combined with a schedule that splits the backward, and one process per pipeline takes one stage.

Pure: no process group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.measure.simulate import schedule_orders
from lightning_pipe.settings import SCHEDULES, SINGLE_STAGE, SPLIT_BACKWARD, V_SHAPED, canonical_schedule


@dataclass(frozen=True, order=True)
class Candidate:
    """One setting of the tuned arguments."""

    schedule: str
    microbatches: int
    stages_per_rank: int
    #: recompute every k-th block (0: none, 1: every block), as the strategy's ``activation_checkpointing``
    activation_checkpointing: int = 0
    compile: bool = False
    #: the layout (0 and ``""``: the strategy's own, not searched): processes per pipeline, how each stage is
    #: replicated over the pipelines (``"ddp"``/``"fsdp"``), processes sharing each stage
    pipeline_size: int = 0
    data_parallel: str = ""
    tensor_parallel: int = 0

    def settings(self) -> dict[str, Any]:
        """The strategy arguments of this candidate (``compile``: ``True``/``False``; the layout's when searched)."""
        out: dict[str, Any] = {
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "microbatch_size": None,
            "stages_per_rank": self.stages_per_rank,
            "activation_checkpointing": self.activation_checkpointing,
            "compile": self.compile,
        }
        if self.pipeline_size:
            out.update(
                pipeline_size=self.pipeline_size, data_parallel=self.data_parallel, tensor_parallel=self.tensor_parallel
            )
        return out

    @property
    def label(self) -> str:
        text = f"{self.schedule} M={self.microbatches} v={self.stages_per_rank}"
        if self.pipeline_size:
            text = f"{self.layout_label} | " + text
        every = self.activation_checkpointing
        if every:
            text += " +ckpt" if every == 1 else f" +ckpt/{every}"
        return text + (" +compile" if self.compile else "")

    @property
    def layout_label(self) -> str:
        """``pp=2 ddp tp=1`` (``no pipeline`` for one process per pipeline)."""
        head = "no pipeline" if self.pipeline_size == 1 else f"pp={self.pipeline_size}"
        return f"{head} {self.data_parallel} tp={self.tensor_parallel}"

    @property
    def eager(self) -> Candidate:
        """The same candidate without ``compile``."""
        return dataclasses.replace(self, compile=False)


@dataclass(frozen=True)
class SearchSpace:
    """The values the tuner tries (every combination that can run).

    Arguments:
        schedules: Schedules by name. Default: all seven of torch.
        microbatches: Microbatch counts. ``"auto"``: the divisors of the batch size from the pipeline size up to
            ``4 * pipeline_size * max(stages_per_rank)``.
        stages_per_rank: Stages per rank for the multi-stage schedules (the single-stage ones always use 1; the V
            schedules 2). Default ``(2,)``.
        activation_checkpointing: Default ``(False, True)``: no block recomputed, or every block (an int ``k``:
            every ``k``-th).
        compile: Default ``(False,)``; ``(False, True)`` also measures compiled blocks (each compiled trial pays the
            compilation, at least seconds per block kind).
        pipeline_sizes: The layout: processes per pipeline. ``None`` (default): the strategy's own; ``"auto"``: every
            divisor of the processes (per tensor-parallel group), 1 (no pipeline: plain data parallelism or FSDP)
            included.
        data_parallel: How stages are replicated over the pipelines: ``None`` (default): the strategy's own;
            e.g. ``("ddp", "fsdp")``.
        tensor_parallel: Processes sharing every stage: ``None`` (default): the strategy's own; e.g. ``(1, 2)``
            (sizes above 1 need a model with a tensor-parallel plan).
    """

    schedules: tuple[str, ...] = SCHEDULES
    microbatches: Union[Literal["auto"], tuple[int, ...]] = "auto"
    stages_per_rank: tuple[int, ...] = (2,)
    activation_checkpointing: tuple[Union[bool, int], ...] = (False, True)
    compile: tuple[bool, ...] = (False,)
    pipeline_sizes: Union[None, Literal["auto"], tuple[int, ...]] = None
    data_parallel: Optional[tuple[str, ...]] = None
    tensor_parallel: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        schedules = tuple(canonical_schedule(s) for s in self.schedules)
        if not schedules or "auto" in schedules:
            raise PipelineConfigError(
                f"`SearchSpace(schedules={self.schedules!r})` must name at least one schedule, not 'auto'. Choose"
                f" among {', '.join(SCHEDULES)}."
            )
        object.__setattr__(self, "schedules", tuple(dict.fromkeys(schedules)))
        if self.microbatches != "auto":
            _check_ints("microbatches", self.microbatches, 1)
            object.__setattr__(self, "microbatches", tuple(sorted(set(self.microbatches))))
        _check_ints("stages_per_rank", self.stages_per_rank, 2)
        object.__setattr__(self, "stages_per_rank", tuple(sorted(set(self.stages_per_rank))))
        every = self.activation_checkpointing
        if not every or not all(isinstance(v, int) and v >= 0 for v in every):
            raise PipelineConfigError(
                f"`SearchSpace(activation_checkpointing={every!r})` must be a non-empty tuple of bools or ints >= 0"
                " (k: every k-th block), e.g. (False, True)."
            )
        object.__setattr__(self, "activation_checkpointing", tuple(dict.fromkeys(int(v) for v in every)))
        if not self.compile or not all(isinstance(v, bool) for v in self.compile):
            raise PipelineConfigError(
                f"`SearchSpace(compile={self.compile!r})` must be a non-empty tuple of bools, e.g. (False, True)."
            )
        object.__setattr__(self, "compile", tuple(dict.fromkeys(self.compile)))
        if self.pipeline_sizes not in (None, "auto"):
            _check_ints("pipeline_sizes", self.pipeline_sizes, 1)
            object.__setattr__(self, "pipeline_sizes", tuple(sorted(set(self.pipeline_sizes))))  # type: ignore[arg-type]
        if self.tensor_parallel is not None:
            _check_ints("tensor_parallel", self.tensor_parallel, 1)
            object.__setattr__(self, "tensor_parallel", tuple(sorted(set(self.tensor_parallel))))
        if self.data_parallel is not None:
            modes = self.data_parallel
            if not isinstance(modes, (tuple, list)) or not modes or not all(m in ("ddp", "fsdp") for m in modes):
                raise PipelineConfigError(
                    f"`SearchSpace(data_parallel={modes!r})` must be a non-empty tuple of 'ddp' and 'fsdp', e.g."
                    " ('ddp', 'fsdp')."
                )
            object.__setattr__(self, "data_parallel", tuple(dict.fromkeys(modes)))

    @property
    def searches_layout(self) -> bool:
        """Whether the space varies the layout (pipeline, data-parallel and tensor-parallel sizes, sharding)."""
        return (self.pipeline_sizes, self.data_parallel, self.tensor_parallel) != (None, None, None)

    def microbatch_counts(self, pipeline_size: int, batch_size: int) -> tuple[int, ...]:
        """The microbatch counts to try for batches of ``batch_size`` samples per pipeline."""
        if self.microbatches != "auto":
            return tuple(m for m in self.microbatches if batch_size % m == 0)
        top = 4 * pipeline_size * max(self.stages_per_rank)
        return tuple(m for m in range(pipeline_size, min(batch_size, top) + 1) if batch_size % m == 0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "schedules": list(self.schedules),
            "microbatches": self.microbatches if self.microbatches == "auto" else list(self.microbatches),
            "stages_per_rank": list(self.stages_per_rank),
            "activation_checkpointing": list(self.activation_checkpointing),
            "compile": list(self.compile),
            **(
                {
                    "pipeline_sizes": self.pipeline_sizes
                    if self.pipeline_sizes in (None, "auto")
                    else list(self.pipeline_sizes),  # type: ignore[arg-type]
                    "data_parallel": None if self.data_parallel is None else list(self.data_parallel),
                    "tensor_parallel": None if self.tensor_parallel is None else list(self.tensor_parallel),
                }
                if self.searches_layout
                else {}
            ),
        }


def _check_ints(name: str, values: Any, least: int) -> None:
    if (
        not isinstance(values, (tuple, list))
        or not values
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= least for v in values)
    ):
        raise PipelineConfigError(
            f"`SearchSpace({name}={values!r})` must be a non-empty tuple of ints >= {least}, e.g."
            f" ({least}, {2 * least})."
        )


def stage_counts(schedule: str, space: SearchSpace) -> tuple[int, ...]:
    """The stages per rank ``schedule`` can run with, of those in ``space``."""
    if schedule in SINGLE_STAGE:
        return (1,)
    if schedule in V_SHAPED:
        return (2,)
    return space.stages_per_rank


def runs(schedule: str, pipeline_size: int, microbatches: int, stages_per_rank: int) -> bool:
    """Whether torch's ``schedule`` takes this many ranks, microbatches and stages per rank."""
    try:
        schedule_orders(schedule, pipeline_size, microbatches, stages_per_rank)
    except ValueError:
        return False
    return True


def candidates(
    space: SearchSpace, pipeline_size: int, batch_size: int, num_blocks: int, layout: Any = None
) -> list[Candidate]:
    """Every candidate of ``space`` that can run: ``batch_size`` samples per batch (per pipeline), ``num_blocks``
    blocks to share out (each stage needs one). In a fixed order (schedules as given, then fewer microbatches,
    fewer stages per rank, without checkpointing, without compile first). ``layout``: a
    :class:`~lightning_pipe.tune.layout.ProcessLayout` the candidates carry (its pipeline size replaces
    ``pipeline_size``; one process per pipeline takes only the single-stage schedules, one stage)."""
    if layout is not None:
        pipeline_size = layout.pipeline_size
    out = []
    for schedule in space.schedules:
        if pipeline_size == 1 and schedule not in SINGLE_STAGE:
            continue
        for microbatches in space.microbatch_counts(pipeline_size, batch_size):
            for spr in stage_counts(schedule, space):
                if pipeline_size * spr > num_blocks or not runs(schedule, pipeline_size, microbatches, spr):
                    continue
                for checkpointing in space.activation_checkpointing:
                    for compiled in space.compile:
                        if compiled and schedule in SPLIT_BACKWARD:
                            continue
                        found = Candidate(schedule, microbatches, spr, checkpointing, compiled)
                        out.append(found if layout is None else layout.carried_by(found))
    return out


def from_settings(settings: Any, microbatches: int) -> Candidate:
    """The candidate that resolved strategy settings (a :class:`~lightning_pipe.settings.PipelineSettings`) amount
    to, with the microbatch count the strategy resolved for the batches it saw."""
    return Candidate(
        settings.schedule,
        microbatches,
        int(settings.stages_per_rank),
        int(settings.activation_checkpointing),
        settings.compile is not None,
    )


def describe(found: Sequence[Candidate]) -> str:
    return ", ".join(c.label for c in found[:4]) + (f", ... ({len(found)} in all)" if len(found) > 4 else "")
