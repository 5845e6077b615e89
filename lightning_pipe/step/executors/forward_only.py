"""Validation, test and predict: a forward-only pass of every stage that is exact for every schedule.

torch's ``schedule.eval()`` cannot serve evaluation: it raises for ZBVZeroBubble and DualPipeV, needs a target when a
loss function is set, infers stage shapes once per schedule (a short last batch would need new schedules) and
corrupts outputs when a batch does not split evenly. This executor runs every rank's stages one microbatch at a time in
one global order (:func:`task_order`), under ``torch.no_grad()`` with the stage modules in eval mode; activations
travel with their shapes (:mod:`lightning_pipe.comm.transport`), so microbatches may differ in size and nothing is
cached between batches. The training schedules, and the shapes torch inferred for them, are never touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Union

import torch

from lightning_pipe.comm import transport
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.step.interception import Call
from lightning_pipe.step.runtime import PipelineRuntime
from lightning_pipe.step.stage import MICROBATCH, StepContext, eval_mode
from lightning_pipe.structures import map_structure

EvalMicrobatches = Union[Literal["auto"], int]


def resolve_eval_microbatches(setting: EvalMicrobatches, size: int, pipeline_size: int) -> int:
    """Microbatches for an evaluation batch of ``size`` samples.

    ``"auto"``: ``pipeline_size`` (the fewest that give every process of the pipeline work at once). Never more than
    the batch has samples: a short last batch runs as single-sample microbatches.
    """
    n = pipeline_size if setting == "auto" else int(setting)
    return max(1, min(n, size))


def microbatch_sizes(size: int, n: int) -> list[int]:
    """Sizes of ``torch.tensor_split(size, n)``: the first ``size % n`` microbatches take one more sample."""
    base, extra = divmod(size, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def plan_microbatches(size: int, setting: EvalMicrobatches, pipeline_size: int, static: int | None) -> list[int]:
    """Microbatch sizes for an evaluation batch of ``size`` samples.

    ``static`` (traced stages, whose graphs may fix the microbatch size): microbatches of that size and a smaller
    remainder, which :func:`pad_rows` fills up to it. Otherwise ``resolve_eval_microbatches`` near-equal microbatches.
    """
    if static is not None:
        full, rest = divmod(size, static)
        return [static] * full + ([rest] if rest else [])
    return microbatch_sizes(size, resolve_eval_microbatches(setting, size, pipeline_size))


def pad_rows(obj: Any, size: int, target: int) -> Any:
    """Pad every tensor with ``size`` rows to ``target`` rows by repeating its last row.

    Evaluation runs in eval mode, where a sample's output does not depend on the other rows, so the padding rows are
    computed and dropped (:func:`trim_rows`) without touching the real ones.
    """
    if size == target:
        return obj

    def pad(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == size:
            return torch.cat([t, t[-1:].expand(target - size, *t.shape[1:])])
        return t

    return map_structure(obj, pad)


def trim_rows(obj: Any, size: int, target: int) -> Any:
    """Undo :func:`pad_rows` on a stage output: keep the first ``size`` of ``target`` rows."""
    if size == target:
        return obj
    return map_structure(
        obj, lambda t: t[:size] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == target else t
    )


def task_order(local_stages: Sequence[int], n: int, pipeline_size: int) -> list[tuple[int, int]]:
    """The ``(microbatch, stage)`` forwards this rank runs, in the order it runs them.

    Every rank sorts by ``(microbatch // pipeline_size, stage, microbatch)``. A forward depends only on the one before
    it (same microbatch, previous stage), which sorts earlier; with non-blocking sends, the earliest unfinished forward
    of all ranks can always run, so no rank waits forever, and between two ranks messages arrive in the order they are
    received. Groups of ``pipeline_size`` microbatches keep every rank of a round-robin or V placement busy.
    """
    return sorted(((m, s) for m in range(n) for s in local_stages), key=lambda t: (t[0] // pipeline_size, t[1], t[0]))


def _as_args(output: Any) -> tuple[Any, ...]:
    # A stage's tuple output is the next stage's received activation tensors, anything else is one tensor.
    return tuple(output) if isinstance(output, (tuple, list)) else (output,)


class ForwardOnlyExecutor:
    """Forward-only pass over a batch's microbatches (which may differ in size) for validation, test and predict."""

    #: a rank holding only the first stage receives nothing here: a step's receives are posted before it starts
    reports_receives = False

    def __init__(self, runtime: PipelineRuntime, settings: PipelineSettings, static: int | None) -> None:
        self.runtime = runtime
        self.eval_microbatches = settings.eval_microbatches
        #: traced stages may fix the microbatch size; microbatches are padded to it
        self.static = static

    def plan(self, size: int) -> list[int]:
        return plan_microbatches(size, self.eval_microbatches, self.runtime.pipeline_size, self.static)

    def run(self, key: tuple, step: StepContext) -> None:
        """Run the step's microbatches through this rank's stages; ``step.on_output(m, output)`` gets the last
        stage's."""
        runtime = self.runtime
        n, sizes = len(step.calls), step.sizes
        if self.static is not None:
            step.calls = [Call(*pad_rows((c.args, c.kwargs), size, self.static)) for c, size in zip(step.calls, sizes)]
        me = runtime.pipeline_rank
        last = runtime.num_stages - 1
        handoff: dict[tuple[int, int], tuple[Any, ...]] = {}
        pending: list[Any] = []
        for module in runtime.stages.values():  # every stage's forward reads the step from its module
            module.step = step
        with torch.no_grad(), eval_mode(list(runtime.stages.values())):
            try:
                for m, s in task_order(sorted(runtime.stages), n, runtime.pipeline_size):
                    module = runtime.stages[s]
                    if s == 0:
                        received: tuple[Any, ...] = ()
                    elif runtime.stage_ranks[s - 1] == me:
                        received = handoff.pop((m, s))
                    else:
                        source = runtime.global_rank_of(s - 1)
                        sent = transport.recv_object(source, runtime.group, runtime.device, runtime.mesh_of)
                        received = _as_args(sent)
                    output = module(*received, **{MICROBATCH: m})
                    if s == last:
                        assert step.on_output is not None
                        output = step.final_output(m, output)
                        if self.static is not None:
                            output = trim_rows(output, sizes[m], self.static)
                        step.on_output(m, output)
                    elif runtime.stage_ranks[s + 1] == me:
                        handoff[(m, s + 1)] = _as_args(output)
                    else:
                        target = runtime.global_rank_of(s + 1)
                        pending.extend(transport.send_object(output, target, runtime.group, runtime.device))
            finally:
                transport.wait_all(pending)
                for module in runtime.stages.values():
                    module.step = None
