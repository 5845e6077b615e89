"""Single-process tests of the evaluation machinery: microbatching, ordering, merging, transport, metric replication."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torchmetrics.aggregation import CatMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_pipe import PipelineParallelStrategy
from lightning_pipe.builder import _reuse
from lightning_pipe.errors import MicrobatchError, PipelineConfigError, PipelineUsageError
from lightning_pipe.evaluation import (
    _replay,
    eval_mode,
    forward_only,
    is_scalar_structure,
    merge_outputs,
    microbatch_sizes,
    pad_rows,
    plan_microbatches,
    resolve_eval_microbatches,
    task_order,
    trim_rows,
)
from lightning_pipe.interception import LoggedValue, merge_microbatch_logs
from lightning_pipe.metrics import MetricRef, apply_updates, bind_metrics, collect_updates, snapshot
from lightning_pipe.microbatch import split_batch
from lightning_pipe.partition import stage_to_rank
from lightning_pipe.transport import pack, send_object, unpack


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
    with pytest.raises(MicrobatchError, match=r"Microbatch sizes \[3, 3\] do not split a batch of 5 samples into 2"):
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
    with pytest.raises(PipelineUsageError, match="cannot be combined across the microbatches of one batch"):
        merge_outputs(["a", "b"], [1, 1], "predict_step")
    with pytest.raises(PipelineUsageError, match="cannot be combined across microbatches: tensors need"):
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
    with pytest.raises(PipelineUsageError, match="cannot be sent to the next pipeline rank"):
        send_object({"fn": lambda x: x}, dst=1, group=None, device=torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------- logs
def test_merge_microbatch_logs_weights_by_microbatch_size():
    logs = [
        [LoggedValue("loss", torch.tensor(1.0)), LoggedValue("peak", 5.0, {"reduce_fx": "max"})],
        [LoggedValue("loss", torch.tensor(4.0)), LoggedValue("peak", 7.0, {"reduce_fx": "max"})],
    ]
    merged = {e.name: e.value for e in merge_microbatch_logs(logs, weights=[3, 1])}
    assert merged == {"loss": pytest.approx(1.75), "peak": 7.0}
    # Without weights (training: equal microbatches) the plain mean.
    assert merge_microbatch_logs(logs)[0].value == pytest.approx(2.5)


def test_merge_microbatch_logs_uses_logged_batch_size_and_skipped_microbatches():
    logs = [[LoggedValue("acc", 1.0, {"batch_size": 3})], [], [LoggedValue("acc", 0.0, {"batch_size": 1})]]
    (entry,) = merge_microbatch_logs(logs, weights=[3, 2, 1])
    assert entry.value == pytest.approx(0.75)
    assert entry.kwargs["batch_size"] == 4
    (cond,) = merge_microbatch_logs([[], [LoggedValue("x", 2.0)], [LoggedValue("x", 5.0)]], weights=[4, 1, 3])
    assert cond.value == pytest.approx((1 * 2.0 + 3 * 5.0) / 4)


# ---------------------------------------------------------------------------------------------------- metrics
class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.seen = CatMetric()
        self.idle = MulticlassAccuracy(num_classes=3)


def _metrics(holder: nn.Module) -> dict:
    return {name: m for name, m in holder.named_modules() if name}


def test_metric_updates_replicate_state_exactly():
    last, other = _Holder(), _Holder()
    for step in range(3):
        before = snapshot(_metrics(last))
        for _ in range(2):  # two microbatches
            preds, target = torch.randint(0, 3, (4,)), torch.randint(0, 3, (4,))
            last.acc(preds, target)
            last.seen.update(preds.float())
        updates = collect_updates(_metrics(last), before)
        assert {u.name for u in updates} == {"acc", "seen"}  # "idle" was not touched
        seen = next(u for u in updates if u.name == "seen")
        assert seen.list_start["value"] == 2 * step and len(seen.lists["value"]) == 2  # only the new entries travel
        apply_updates(_metrics(other), updates, torch.device("cpu"))
    assert other.acc.compute() == last.acc.compute()
    assert torch.equal(other.seen.compute(), last.seen.compute())
    assert other.acc._update_count == last.acc._update_count == 6
    # A reset on the last stage resets the replicas too.
    before = snapshot(_metrics(last))
    last.seen.reset()
    apply_updates(_metrics(other), collect_updates(_metrics(last), before), torch.device("cpu"))
    assert other.seen.value == [] and other.seen._update_count == 0


def test_bind_metrics_keeps_a_user_process_group():
    holder = _Holder()
    holder.idle.process_group = "mine"
    bind_metrics(holder, "dp")
    assert (
        holder.acc.process_group == "dp" and holder.seen.process_group == "dp" and holder.idle.process_group == "mine"
    )


def test_replay_refuses_a_metric_that_is_not_an_attribute():
    runtime = SimpleNamespace(replay_logs=lambda result: None)
    with pytest.raises(PipelineUsageError, match="not an attribute of the LightningModule"):
        _replay(runtime, [LoggedValue("val_acc", MetricRef(None))], {})


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
    runtime = SimpleNamespace(
        stage_modules=[(0, first), (1, second)],
        stage_ranks=[0, 0],
        num_stages=2,
        group=None,
        group_ranks=[0],
        device=torch.device("cpu"),
    )
    x = torch.randn(5, 4)
    chunks = x.tensor_split(2)
    outputs = {}
    forward_only(runtime, [((c,), {}) for c in chunks], 2, lambda m, out: outputs.__setitem__(m, out))
    assert not outputs[0].requires_grad
    expected = second(first.eval()(x))
    torch.testing.assert_close(torch.cat([outputs[0], outputs[1]]), expected)
    assert first.training is False  # restored to what it was before the pass (set by the reference call above)


def test_reuse_refuses_another_layout():
    runtime = SimpleNamespace(split=("auto", "modules", "auto", None, None, 2, 0, 1, "1F1B"))
    with pytest.raises(PipelineConfigError, match="already split for another pipeline"):
        _reuse(runtime, ("auto", "modules", "auto", None, None, 4, 0, 1, "1F1B"), "auto", None, None, [0, 1, 2, 3])


def test_settle_step_values_gives_the_full_batch_forward_value():
    from torchmetrics import MaxMetric
    from torchmetrics.classification import MulticlassAccuracy

    from lightning_pipe.metrics import settle_step_values

    g = torch.Generator().manual_seed(0)
    preds, target = torch.randn(12, 5, generator=g), torch.randint(0, 5, (12,), generator=g)
    acc, reference, peak = MulticlassAccuracy(5, average="micro"), MulticlassAccuracy(5, average="micro"), MaxMetric()
    acc(preds[:4], target[:4])  # an earlier step
    metrics = {"acc": acc, "peak": peak}
    before = snapshot(metrics)
    for chunk in range(1, 3):
        acc(preds[4 * chunk : 4 * chunk + 4], target[4 * chunk : 4 * chunk + 4])
        peak(torch.tensor(float(chunk)))
    last_microbatch = float(acc._forward_cache)
    settle_step_values(metrics, before)
    whole = float(reference(preds[4:], target[4:]))
    assert float(acc._forward_cache) == pytest.approx(whole) and whole != pytest.approx(last_microbatch)
    assert float(acc.compute()) == pytest.approx(float(MulticlassAccuracy(5, average="micro")(preds, target)))
    assert float(peak._forward_cache) == 2.0  # max-reduced state: the last microbatch's value is kept
