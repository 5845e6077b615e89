"""Validation, test and predict steps under pipeline parallelism: a forward-only pass that is exact for every schedule.

torch's ``schedule.eval()`` cannot serve evaluation: it raises for ZBVZeroBubble and DualPipeV, needs a target when a
loss function is set, infers stage shapes once per schedule (a short last batch would need new schedules) and corrupts
outputs when a batch does not split evenly. Evaluation therefore runs its own executor:

- every rank runs its stages' forwards, one microbatch at a time, in one global order (:func:`task_order`), under
  ``torch.no_grad()`` with the stage modules in eval mode; activations travel with their shapes
  (:mod:`lightning_pipe.transport`), so microbatches may differ in size and nothing is cached between batches. The
  training schedules, and the shapes torch inferred for them, are never touched;
- as in training, the first-stage rank runs the user's hook on each microbatch until it calls the network (those
  arguments are the pipeline input) and the last-stage rank runs the user's hook per microbatch with the network call
  answered by that microbatch's output, recording ``self.log`` calls;
- the last-stage rank merges the logs (weighted by microbatch size) and broadcasts them with the changes its
  torchmetrics objects went through, so every rank logs the same keys and values and holds the same metric states;
- ``predict_step`` outputs are merged into the batch's predictions and sent once, to pipeline rank 0.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe import transport
from lightning_pipe.errors import PipelineConfigError, PipelineUsageError
from lightning_pipe.interception import LoggedValue, merge_microbatch_logs, recording_logs
from lightning_pipe.metrics import (
    _CPU,
    MetricUpdate,
    apply_updates,
    collect_updates,
    portable_logs,
    resolve_refs,
    settle_step_values,
    snapshot,
    to_device,
)
from lightning_pipe.microbatch import batch_size, signature, split_batch

if TYPE_CHECKING:
    from lightning_pipe.runtime import PipelineRuntime

EvalMicrobatches = Union[Literal["auto"], int]
EVAL_HOOKS = ("validation_step", "test_step", "predict_step")


# ---------------------------------------------------------------------------------------------------- settings
def check_eval_microbatches(value: Any) -> None:
    """Validate the strategy's ``eval_microbatches`` argument."""
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PipelineConfigError(
            f"`eval_microbatches` must be 'auto' or an int >= 1, got {value!r}. 'auto' uses one microbatch per"
            " process of the pipeline."
        )


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

    return transport.map_structure(obj, pad)


def trim_rows(obj: Any, size: int, target: int) -> Any:
    """Undo :func:`pad_rows` on a stage output: keep the first ``size`` of ``target`` rows."""
    if size == target:
        return obj
    return transport.map_structure(
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


# ---------------------------------------------------------------------------------------------------- outputs
def merge_outputs(outputs: Sequence[Any], sizes: Sequence[int], hook: str) -> Any:
    """Combine one batch's per-microbatch step outputs into the output of one full-batch call.

    Tensors with a batch dimension are concatenated along dim 0; 0-dim floating tensors and floats (a mean loss) take
    the microbatch-size-weighted mean, 0-dim integer tensors (counts) the sum; dicts, lists and tuples are merged
    entry by entry; other values must be equal in every microbatch.
    """
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]
    if isinstance(first, torch.Tensor) and all(isinstance(o, torch.Tensor) for o in outputs):
        return _merge_tensors(outputs, sizes)
    if isinstance(first, Mapping) and all(isinstance(o, Mapping) and o.keys() == first.keys() for o in outputs):
        merged = {k: merge_outputs([o[k] for o in outputs], sizes, hook) for k in first}
        return merged if type(first) is dict else type(first)(merged)
    if isinstance(first, (list, tuple)) and all(type(o) is type(first) and len(o) == len(first) for o in outputs):
        columns = [merge_outputs([o[i] for o in outputs], sizes, hook) for i in range(len(first))]
        return type(first)(*columns) if hasattr(first, "_fields") else type(first)(columns)
    if isinstance(first, float) and all(isinstance(o, numbers.Real) for o in outputs):
        return math.fsum(float(o) * s for o, s in zip(outputs, sizes)) / sum(sizes)
    if all(_same(o, first) for o in outputs):
        return first
    raise PipelineUsageError(
        f"`{hook}` returned values ({_describe(outputs)}) that cannot be combined across the microbatches of one"
        " batch. Return tensors with a batch dimension (concatenated), scalar tensors (averaged), or dicts/lists/tuples"
        " of them, or pass `eval_microbatches=1` to the strategy so each batch runs as one microbatch."
    )


def _merge_tensors(tensors: Sequence[torch.Tensor], sizes: Sequence[int]) -> torch.Tensor:
    first = tensors[0]
    if first.dim() > 0 and all(t.dim() == first.dim() and t.shape[1:] == first.shape[1:] for t in tensors):
        return torch.cat(list(tensors))
    if all(t.dim() == 0 for t in tensors):
        if first.is_floating_point():
            weights = torch.tensor(sizes, dtype=torch.float64, device=first.device)
            mean = (torch.stack(list(tensors)).double() * weights).sum() / weights.sum()
            return mean.to(first.dtype)
        return torch.stack(list(tensors)).sum()
    raise PipelineUsageError(
        f"Step outputs of shapes {[tuple(t.shape) for t in tensors]} cannot be combined across microbatches: tensors"
        " need the same number of dimensions and equal sizes beyond dim 0. Pass `eval_microbatches=1` to the strategy"
        " so each batch runs as one microbatch."
    )


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values whose == raises or is ambiguous are not "the same"
        return False


def _describe(outputs: Sequence[Any]) -> str:
    return ", ".join(sorted({type(o).__name__ for o in outputs}))


def is_scalar_structure(obj: Any) -> bool:
    """Whether ``obj`` holds only scalars (numbers, strings, None, one-element tensors): cheap to broadcast."""
    ok = [True]

    def check(leaf: Any) -> None:
        if isinstance(leaf, torch.Tensor):
            ok[0] = ok[0] and leaf.numel() <= 1
        elif not (leaf is None or isinstance(leaf, (numbers.Number, str))):
            ok[0] = False

    transport.map_structure(obj, check)
    return ok[0]


# ---------------------------------------------------------------------------------------------------- metrics
# ---------------------------------------------------------------------------------------------------- executor
@contextmanager
def eval_mode(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Every module in eval mode (dropout off, BatchNorm on running statistics); each one's own flag restored after.

    Stage views are shallow copies of the network, so their containers carry ``training`` flags of their own that
    ``LightningModule.eval()`` does not reach.
    """
    flags = [(m, m.training) for root in modules for m in root.modules()]
    for m, _ in flags:
        m.training = False
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _as_args(output: Any) -> tuple[Any, ...]:
    # torch's stages pass a tuple/list output on as positional arguments of the next stage, anything else as one.
    return tuple(output) if isinstance(output, (tuple, list)) else (output,)


def pipeline_rank(runtime: PipelineRuntime) -> int:
    if runtime.group is None or len(runtime.group_ranks) == 1:
        return 0
    return runtime.group_ranks.index(dist.get_rank())


def forward_only(
    runtime: PipelineRuntime,
    inputs: Sequence[tuple[tuple[Any, ...], dict[str, Any]]] | None,
    n: int,
    on_output: Callable[[int, Any], None],
) -> None:
    """Run ``n`` microbatches through this rank's stages; ``on_output(m, output)`` receives the last stage's outputs.

    ``inputs`` (first-stage rank only) are the network's ``(args, kwargs)`` per microbatch.
    """
    me = pipeline_rank(runtime)
    modules = dict(runtime.stage_modules)
    last = runtime.num_stages - 1
    local_handoff: dict[tuple[int, int], tuple[Any, ...]] = {}
    pending: list[Any] = []
    with torch.no_grad(), eval_mode(list(modules.values())):
        try:
            for m, s in task_order(sorted(modules), n, len(runtime.group_ranks)):
                if s == 0:
                    assert inputs is not None
                    args, kwargs = inputs[m]
                elif runtime.stage_ranks[s - 1] == me:
                    args, kwargs = local_handoff.pop((m, s)), {}
                else:
                    src = runtime.group_ranks[runtime.stage_ranks[s - 1]]
                    args, kwargs = _as_args(transport.recv_object(src, runtime.group, runtime.device)), {}
                output = modules[s](*args, **kwargs)
                if s == last:
                    on_output(m, output)
                elif runtime.stage_ranks[s + 1] == me:
                    local_handoff[(m, s + 1)] = _as_args(output)
                else:
                    dst = runtime.group_ranks[runtime.stage_ranks[s + 1]]
                    pending.extend(transport.send_object(output, dst, runtime.group, runtime.device))
        finally:
            transport.wait_all(pending)


# ---------------------------------------------------------------------------------------------------- step
@dataclass
class _Shared:
    """What the last-stage rank broadcasts to the rest of its pipeline after an evaluation step."""

    logs: list[LoggedValue]
    metric_updates: list[MetricUpdate]
    output: Any
    output_shared: bool


def eval_step(
    runtime: PipelineRuntime, hook: str, batch: Any, extra_args: tuple[Any, ...], eval_microbatches: EvalMicrobatches
) -> Any:
    """Run the user's ``hook`` (``validation_step``/``test_step``/``predict_step``) on ``batch`` through the pipeline.

    Returns, for ``validation_step``/``test_step``, the merged step output on the last-stage rank and on every rank
    when it holds only scalars (else ``None`` there); for ``predict_step``, the batch's predictions on pipeline rank 0
    and ``None`` on the other ranks.
    """
    lightning_module = runtime.lightning_module
    step = getattr(lightning_module, hook)
    static = getattr(runtime, "static_microbatch_size", None)
    sizes = plan_microbatches(batch_size(batch), eval_microbatches, len(runtime.group_ranks), static)
    n = len(sizes)
    runtime._check_same_batch(("eval", signature(batch)), n)
    microbatches = split_batch(batch, n, sizes)
    runtime.interceptor.hook = hook
    inputs = None
    if runtime.has_first:
        inputs = []
        for mb, size in zip(microbatches, sizes):
            with recording_logs(lightning_module, []):
                captured = runtime.interceptor.capture(lambda mb=mb: step(mb, *extra_args))
            inputs.append(pad_rows(captured, size, static or size))
    metrics = runtime.metrics
    before = snapshot(metrics) if runtime.has_last else {}
    results: dict[int, Any] = {}
    logs: dict[int, list[LoggedValue]] = {}

    def on_output(m: int, output: Any) -> None:
        output = trim_rows(output, sizes[m], static or sizes[m])
        results[m], logs[m] = runtime.run_user_step(hook, microbatches[m], extra_args, output)

    forward_only(runtime, inputs, n, on_output)
    shared = _share(runtime, hook, metrics, before, results, logs, sizes)
    if not runtime.has_last:
        apply_updates(metrics, shared.metric_updates, runtime.device)
    _replay(runtime, shared.logs, metrics)
    if hook == "predict_step":
        return _predictions_to_rank_zero(runtime, shared.output)
    return shared.output if runtime.has_last or shared.output_shared else None


def _share(
    runtime: PipelineRuntime,
    hook: str,
    metrics: Mapping[str, nn.Module],
    before: Mapping[str, Any],
    results: Mapping[int, Any],
    logs: Mapping[int, list[LoggedValue]],
    sizes: Sequence[int],
) -> _Shared:
    """Merge the last stage's microbatch results and broadcast what every rank needs (never the predictions)."""
    payload: list[Any] = [None]
    local: _Shared | None = None
    if runtime.has_last:
        n = len(sizes)
        merged_logs = merge_microbatch_logs([logs[i] for i in range(n)], weights=sizes)
        output = merge_outputs([results[i] for i in range(n)], sizes, hook)
        portable = portable_logs(merged_logs, metrics)
        shareable = hook != "predict_step" and is_scalar_structure(output)
        settle_step_values(metrics, before)
        updates = collect_updates(metrics, before)
        local = _Shared(merged_logs, updates, output, shareable)
        payload = [_Shared(portable, updates, to_device(output, _CPU) if shareable else None, shareable)]
    if runtime.group is not None and len(runtime.group_ranks) > 1:
        dist.broadcast_object_list(payload, src=runtime.last_stage_global_rank, group=runtime.group)
    if local is not None:
        return local
    received: _Shared = payload[0]
    received.output = to_device(received.output, runtime.device)
    return received


def _replay(runtime: PipelineRuntime, logs: Sequence[LoggedValue], metrics: Mapping[str, nn.Module]) -> None:
    from lightning_pipe.runtime import StepResult

    resolved = resolve_refs(logs, metrics)
    if resolved:
        runtime.replay_logs(StepResult(None, resolved))


def _predictions_to_rank_zero(runtime: PipelineRuntime, output: Any) -> Any:
    """The last stage's predictions, moved once to pipeline rank 0 when the last stage lives elsewhere."""
    source = runtime.stage_ranks[runtime.num_stages - 1]
    me = pipeline_rank(runtime)
    if source == 0:
        return output if me == 0 else None
    if runtime.has_last:
        transport.wait_all(transport.send_object(output, runtime.group_ranks[0], runtime.group, runtime.device))
        return None
    if me == 0:
        return transport.recv_object(runtime.last_stage_global_rank, runtime.group, runtime.device)
    return None
