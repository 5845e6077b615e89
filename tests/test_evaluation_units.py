"""Single-process tests of the step machinery: microbatching, ordering, merging, transport, metric step values and
replication."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torchmetrics.aggregation import CatMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_pipe import PipelineParallelStrategy
from lightning_pipe.comm.transport import pack, send_object, unpack
from lightning_pipe.errors import MicrobatchError, PipelineConfigError, PipelineUsageError
from lightning_pipe.microbatch import split_batch
from lightning_pipe.models.plain import call_with_activation
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.split.builder import check_same_split
from lightning_pipe.split.partition import stage_to_rank
from lightning_pipe.step.executors import ForwardOnlyExecutor
from lightning_pipe.step.executors.forward_only import (
    microbatch_sizes,
    pad_rows,
    plan_microbatches,
    resolve_eval_microbatches,
    task_order,
    trim_rows,
)
from lightning_pipe.step.interception import Call, LoggedValue
from lightning_pipe.step.merging import is_scalar_structure, merge_microbatch_logs, merge_outputs
from lightning_pipe.step.metrics import MetricMirror, MetricRef, bind_metrics
from lightning_pipe.step.runtime import PipelineRuntime
from lightning_pipe.step.stage import StageModule, StepContext, eval_mode


# ---------------------------------------------------------------------------------------------------- settings
def test_eval_microbatches_auto_is_pipeline_size_capped_by_batch():
    assert resolve_eval_microbatches("auto", 8, 4) == 4
    assert resolve_eval_microbatches("auto", 3, 4) == 3
    assert resolve_eval_microbatches(3, 8, 2) == 3
    assert resolve_eval_microbatches(16, 5, 2) == 5


@pytest.mark.parametrize("bad", [0, -1, 2.0, "four", True])
def test_eval_microbatches_rejected_in_constructor(bad):
    with pytest.raises(PipelineConfigError, match=r"`eval_microbatches` must be 'auto' or an int >= 1, got"):
        PipelineParallelStrategy(eval_microbatches=bad)


@pytest.mark.parametrize("size,n", [(8, 2), (5, 2), (5, 4), (7, 3), (1, 1)])
def test_microbatch_sizes_match_tensor_split(size, n):
    assert microbatch_sizes(size, n) == [len(c) for c in torch.arange(size).tensor_split(n)]
    x = torch.arange(size)
    assert [len(mb[0]) for mb in split_batch((x, x), n, microbatch_sizes(size, n))] == microbatch_sizes(size, n)


def test_split_batch_stays_even_for_training():
    with pytest.raises(MicrobatchError, match="does not split into 2 equal microbatches"):
        split_batch(torch.zeros(5, 3), 2)
    with pytest.raises(MicrobatchError, match=r"Microbatch sizes \[3, 3\].*batch of 5 samples into 2"):
        split_batch(torch.zeros(5, 3), 2, [3, 3])


def test_traced_stages_get_their_microbatch_size_and_a_padded_remainder():
    assert plan_microbatches(13, "auto", 2, static=4) == [4, 4, 4, 1]
    assert plan_microbatches(8, 3, 2, static=4) == [4, 4]
    assert plan_microbatches(5, "auto", 2, static=None) == [3, 2]
    x = torch.arange(6).view(3, 2)
    padded = pad_rows(((x, torch.tensor(7.0)), {"mask": x[:, :1]}), 3, 4)
    assert torch.equal(padded[0][0], torch.tensor([[0, 1], [2, 3], [4, 5], [4, 5]]))
    assert padded[0][1].item() == 7.0 and padded[1]["mask"].shape == (4, 1)
    assert torch.equal(trim_rows(padded[0][0], 3, 4), x)
    assert pad_rows(x, 3, 3) is x


# ---------------------------------------------------------------------------------------------------- ordering
def _simulate(placement: list[int], pipeline_size: int, n: int) -> None:
    """Run every rank's task list with blocking receives and buffered sends; fail on deadlock or mismatched order."""
    num_stages = len(placement)
    tasks = {
        r: task_order([s for s in range(num_stages) if placement[s] == r], n, pipeline_size)
        for r in range(pipeline_size)
    }
    done: set[tuple[int, int]] = set()
    queues: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
    progress = True
    while progress:
        progress = False
        for r, todo in tasks.items():
            while todo:
                m, s = todo[0]
                if s > 0 and placement[s - 1] != r:
                    queue = queues[(placement[s - 1], r)]
                    if not queue:
                        break
                    assert queue.popleft() == (m, s - 1), "messages between two ranks arrive out of order"
                elif s > 0:
                    assert (m, s - 1) in done
                todo.pop(0)
                done.add((m, s))
                if s + 1 < num_stages and placement[s + 1] != r:
                    queues[(r, placement[s + 1])].append((m, s))
                progress = True
    assert len(done) == n * num_stages, f"deadlock after {len(done)} of {n * num_stages} forwards"


@pytest.mark.parametrize("pipeline_size", [1, 2, 3, 4])
@pytest.mark.parametrize("stages_per_rank,style", [(1, "loop"), (2, "loop"), (3, "loop"), (2, "v")])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_task_order_never_deadlocks(pipeline_size, stages_per_rank, style, n):
    _simulate(stage_to_rank(pipeline_size * stages_per_rank, pipeline_size, style), pipeline_size, n)


def test_task_order_fills_the_pipeline_in_groups():
    assert task_order([0, 2], 4, 2) == [(0, 0), (1, 0), (0, 2), (1, 2), (2, 0), (3, 0), (2, 2), (3, 2)]


# ---------------------------------------------------------------------------------------------------- outputs
def test_merge_outputs_concatenates_and_weights():
    a, b = torch.randn(3, 2), torch.randn(2, 2)
    merged = merge_outputs(
        [
            {"x": a, "loss": torch.tensor(1.0), "n": torch.tensor(3)},
            {"x": b, "loss": torch.tensor(4.0), "n": torch.tensor(2)},
        ],
        [3, 2],
        "predict_step",
    )
    assert torch.equal(merged["x"], torch.cat([a, b]))
    assert merged["loss"].item() == pytest.approx((3 * 1.0 + 2 * 4.0) / 5)
    assert merged["n"].item() == 5
    Pair = collections.namedtuple("Pair", "left right")
    pair = merge_outputs([Pair(a, "tag"), Pair(b, "tag")], [3, 2], "predict_step")
    assert isinstance(pair, Pair) and pair.right == "tag" and pair.left.shape == (5, 2)
    assert merge_outputs([None, None], [1, 1], "validation_step") is None
    assert merge_outputs([1.0, 4.0], [3, 1], "validation_step") == pytest.approx(1.75)
    only = {"x": a}
    assert merge_outputs([only], [3], "predict_step") is only


def test_merge_outputs_refuses_what_it_cannot_combine():
    with pytest.raises(
        PipelineUsageError,
        match=r"`predict_step` returned values \(str\).*combined across.*microbatches.*`eval_microbatches=1`",
    ):
        merge_outputs(["a", "b"], [1, 1], "predict_step")
    with pytest.raises(
        PipelineUsageError,
        match=r"shapes \[\(2, 3\), \(2, 4\)\] cannot be combined.*same number of dimensions.*`eval_microbatches=1`",
    ):
        merge_outputs([torch.zeros(2, 3), torch.zeros(2, 4)], [2, 2], "predict_step")


def test_is_scalar_structure():
    assert is_scalar_structure({"loss": torch.tensor(1.0), "n": 3, "tag": "x", "none": None})
    assert not is_scalar_structure({"logits": torch.zeros(2, 3)})
    assert not is_scalar_structure([object()])


# ---------------------------------------------------------------------------------------------------- transport
def test_pack_roundtrip_keeps_structure():
    Pair = collections.namedtuple("Pair", "a b")
    obj = collections.OrderedDict(x=torch.arange(6).view(2, 3), y=[Pair(torch.ones(1), 2.5), "s"], z=None)
    skeleton, tensors = pack(obj)
    assert len(tensors) == 2
    back = unpack(skeleton, tensors)
    assert type(back) is collections.OrderedDict and isinstance(back["y"][0], Pair)
    assert torch.equal(back["x"], obj["x"]) and back["y"][0].b == 2.5 and back["y"][1] == "s" and back["z"] is None


def test_send_object_refuses_unpicklable_outputs():
    with pytest.raises(
        PipelineUsageError, match=r"of type dict.*cannot be sent to.*pipeline rank.*pickle.*must be tensors"
    ):
        send_object({"fn": lambda x: x}, dst=1, group=None, device=torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------- logs
def test_merge_microbatch_logs_weights_by_microbatch_size():
    logs = [
        [LoggedValue("loss", torch.tensor(1.0)), LoggedValue("peak", 5.0, {"reduce_fx": "max"})],
        [LoggedValue("loss", torch.tensor(4.0)), LoggedValue("peak", 7.0, {"reduce_fx": "max"})],
    ]
    merged = {e.name: float(e.value) for e in merge_microbatch_logs(logs, weights=[3, 1])}
    assert merged == {"loss": pytest.approx(1.75), "peak": 7.0}
    # Without weights (training: equal microbatches) the plain mean.
    assert float(merge_microbatch_logs(logs)[0].value) == pytest.approx(2.5)


def test_merge_microbatch_logs_uses_logged_batch_size_and_skipped_microbatches():
    logs = [[LoggedValue("acc", 1.0, {"batch_size": 3})], [], [LoggedValue("acc", 0.0, {"batch_size": 1})]]
    (entry,) = merge_microbatch_logs(logs, weights=[3, 2, 1])
    assert float(entry.value) == pytest.approx(0.75)
    assert entry.kwargs["batch_size"] == 4
    (cond,) = merge_microbatch_logs([[], [LoggedValue("x", 2.0)], [LoggedValue("x", 5.0)]], weights=[4, 1, 3])
    assert float(cond.value) == pytest.approx((1 * 2.0 + 3 * 5.0) / 4)


# ---------------------------------------------------------------------------------------------------- metrics
class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.seen = CatMetric()
        self.idle = MulticlassAccuracy(num_classes=3)


def test_metric_updates_replicate_state_exactly():
    last, other = _Holder(), _Holder()
    sender, receiver = MetricMirror(last), MetricMirror(other)
    for step in range(3):
        with sender.step(record_step_values=True) as metrics:
            for _ in range(2):  # two microbatches
                preds, target = torch.randint(0, 3, (4,)), torch.randint(0, 3, (4,))
                last.acc(preds, target)
                last.seen.update(preds.float())
            metrics.settle()
            updates = metrics.updates()
        assert {u.name for u in updates} == {"acc", "seen"}  # "idle" was not touched
        seen = next(u for u in updates if u.name == "seen")
        assert seen.list_start["value"] == 2 * step and len(seen.lists["value"]) == 2  # only the new entries travel
        receiver.apply(updates, torch.device("cpu"))
    assert other.acc.compute() == last.acc.compute()
    assert torch.equal(other.seen.compute(), last.seen.compute())
    assert other.acc.update_count == last.acc.update_count == 6
    # A reset on the last stage resets the replicas too.
    with sender.step(record_step_values=False) as metrics:
        last.seen.reset()
        updates = metrics.updates()
    receiver.apply(updates, torch.device("cpu"))
    assert other.seen.value == [] and other.seen.update_count == 0


def test_bind_metrics_keeps_a_user_process_group():
    holder = _Holder()
    holder.idle.process_group = "mine"
    undo = bind_metrics(holder, "dp")
    assert (
        holder.acc.process_group == "dp" and holder.seen.process_group == "dp" and holder.idle.process_group == "mine"
    )
    undo()  # when the Trainer entry ends, the metrics are as the user made them
    assert (
        holder.acc.process_group is None and holder.seen.process_group is None and holder.idle.process_group == "mine"
    )


def test_replay_refuses_a_metric_that_is_not_an_attribute():
    with pytest.raises(
        PipelineUsageError,
        match=r"`self\.log\('val_acc', <metric>\)`.*not an attribute.*LightningModule.*`self\.val_acc = Accuracy",
    ):
        MetricMirror(nn.Module()).resolve(MetricRef(None), "val_acc")


# ---------------------------------------------------------------------------------------------------- executor
def test_eval_mode_restores_each_flag():
    net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    net[1].eval()
    with eval_mode([net]):
        assert not any(m.training for m in net.modules())
    assert net.training and net[0].training and not net[1].training


def test_forward_only_on_one_rank_runs_stages_in_eval_mode_without_grad():
    torch.manual_seed(0)
    first, second = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.9)), nn.Sequential(nn.Linear(4, 2))
    stages = {i: StageModule(body, i, 2, call_with_activation) for i, body in enumerate([first, second])}
    runtime = PipelineRuntime(stages, 2, [0, 0], None, torch.device("cpu"), mesh_of=lambda axes: None)
    x = torch.randn(5, 4)
    executor = ForwardOnlyExecutor(runtime, PipelineSettings(eval_microbatches=2), None)
    sizes = executor.plan(len(x))
    outputs = {}
    step = StepContext([Call((c,), {}) for c in x.split(sizes)], sizes, on_output=outputs.__setitem__)
    executor.run(("eval",), step)
    assert not outputs[0].requires_grad
    expected = second(first.eval()(x))
    torch.testing.assert_close(torch.cat([outputs[0], outputs[1]]), expected)
    assert first.training is False  # restored to what it was before the pass (set by the reference call above)


def test_reuse_accepts_the_same_stages_and_refuses_other_ones():
    def split(**settings):
        resolved = PipelineSettings(**settings).resolve(4)
        return SimpleNamespace(key=resolved.split_key(), described=resolved.describe_split())

    first = split(schedule="1F1B", pipeline_size=2)
    # Same stages: another schedule of the same placement, other activation checkpointing or data parallelism.
    for same in (
        split(schedule="GPipe", pipeline_size=2),
        split(schedule="1F1B", pipeline_size=2, activation_checkpointing=True, data_parallel="fsdp"),
    ):
        check_same_split(first, same.key, same.described)
    interleaved = split(schedule="Interleaved1F1B", pipeline_size=2)
    check_same_split(interleaved, split(schedule="LoopedBFS", pipeline_size=2).key, "")
    with pytest.raises(
        PipelineConfigError, match=r"already split into.*pipeline_size=2.*need other stages \(pipeline_size=4\)"
    ):
        check_same_split(first, split(schedule="1F1B", pipeline_size=4).key, "pipeline_size=4")
    with pytest.raises(PipelineConfigError, match=r"placement='v' \(schedule ZBVZeroBubble\)"):
        zbv = split(schedule="ZBVZeroBubble", pipeline_size=2)
        check_same_split(interleaved, zbv.key, zbv.described)


def test_step_values_are_the_full_batch_values():
    from torchmetrics import MaxMetric
    from torchmetrics.classification import MulticlassAccuracy

    g = torch.Generator().manual_seed(0)
    preds, target = torch.randn(12, 5, generator=g), torch.randint(0, 5, (12,), generator=g)
    holder = nn.Module()
    holder.acc, holder.peak = MulticlassAccuracy(5, average="micro"), MaxMetric()
    reference = MulticlassAccuracy(5, average="micro")
    holder.acc(preds[:4], target[:4])  # an earlier step
    mirror = MetricMirror(holder)
    with mirror.step(record_step_values=True) as metrics:
        outputs = []
        for chunk in range(1, 3):
            outputs.append(holder.acc(preds[4 * chunk : 4 * chunk + 4], target[4 * chunk : 4 * chunk + 4]))
            holder.peak(torch.tensor(float(3 - chunk)))
        last_microbatch = float(holder.acc._forward_cache)
        metrics.settle()
    whole = float(reference(preds[4:], target[4:]))
    assert float(holder.acc._forward_cache) == pytest.approx(whole) and whole != pytest.approx(last_microbatch)
    assert float(holder.acc.compute()) == pytest.approx(float(MulticlassAccuracy(5, average="micro")(preds, target)))
    # max-reduced state: the batch's max (2.0, the first microbatch's), not the last microbatch's (1.0)
    assert float(holder.peak._forward_cache) == 2.0
    # a logged forward output of the metric resolves to the batch value
    found = [metrics.step_value_of(o) for o in outputs]
    assert all(ok for ok, _ in found) and float(found[0][1]) == pytest.approx(whole)
