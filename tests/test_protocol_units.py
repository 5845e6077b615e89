"""Single-process tests of the step protocol's pieces: token weighting, stage calls, the outcome channel's encoding,
the mesh layout and their error messages."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe import PipelineParallelStrategy
from lightning_pipe.comm.mesh import MeshLayout
from lightning_pipe.errors import PipelineConfigError, PipelineUsageError
from lightning_pipe.models.plain import call_with_activation
from lightning_pipe.step.interception import Call, LoggedValue
from lightning_pipe.step.metrics import MetricRef, MetricUpdate
from lightning_pipe.step.protocol import Outcome, _check_items, _loss_and_items, _weighted_mean
from lightning_pipe.step.sharing import flatten, rebuild
from lightning_pipe.step.stage import StageModule, StepContext


# ---------------------------------------------------------------------------------------------------- num_items
def test_num_items_is_read_and_checked():
    loss, items = _loss_and_items("training_step", {"loss": torch.tensor(2.0), "num_items": torch.tensor(7)})
    assert float(loss) == 2.0 and int(items) == 7
    assert _loss_and_items("training_step", torch.tensor(1.0))[1] is None
    with pytest.raises(
        PipelineUsageError,
        match=r"`training_step` returned `num_items=\[1, 2\]`.*number of items.*non-negative integer",
    ):
        _loss_and_items("training_step", {"loss": torch.tensor(1.0), "num_items": torch.tensor([1, 2])})
    with pytest.raises(PipelineUsageError, match="returned `num_items=2.5`"):
        _loss_and_items("training_step", {"loss": torch.tensor(1.0), "num_items": 2.5})


def test_num_items_from_all_microbatches_or_none():
    assert _check_items("training_step", [torch.tensor(3), torch.tensor(4)])
    assert not _check_items("training_step", [None, None])
    with pytest.raises(
        PipelineUsageError, match=r"`training_step` returned `num_items` for some.*but not for others.*every step"
    ):
        _check_items("training_step", [torch.tensor(3), None])
    with pytest.raises(PipelineUsageError, match="returned `num_items` that sum to 0 over the batch"):
        _check_items("validation_step", [torch.tensor(0), torch.tensor(0)])


# ---------------------------------------------------------------------------------------------------- stage calls
class _Net(nn.Module):
    def forward(self, idx, mask=None, scale=1.0):
        return (idx if mask is None else idx * mask) * scale


def test_activation_takes_the_place_of_the_first_input():
    net, h, mask = _Net(), torch.ones(2, 3), torch.tensor([[1.0, 0.0, 1.0]] * 2)
    # positional call: the received activation replaces `idx`, the mask and scale stay the microbatch's own
    out = call_with_activation(net, (torch.zeros(2, 3, dtype=torch.long), mask), {"scale": 2.0}, (h,), False, True)
    assert torch.equal(out, h * mask * 2)
    # keyword call: the activation goes into the keyword of forward's first parameter
    out = call_with_activation(net, (), {"idx": torch.zeros(2), "mask": mask}, (h,), False, True)
    assert torch.equal(out, h * mask)
    with pytest.raises(
        PipelineUsageError, match=r"_Net .*keyword arguments \['mask'\] only.*1 activation.*positionally"
    ):
        call_with_activation(net, (), {"mask": mask}, (h,), False, True)


def test_a_stage_before_the_last_must_return_tensors():
    step = StepContext([Call((torch.ones(2),), {})], [2])
    stage = StageModule(nn.Identity(), 0, 2, lambda *a: {"hidden": torch.ones(2)})
    stage.step = step
    with pytest.raises(
        PipelineUsageError, match=r"Pipeline stage 0 returned dict.*before the last.*tensor or a tuple.*hidden state"
    ):
        stage(microbatch=0)


def test_the_last_stage_packs_and_rebuilds_any_output():
    step = StepContext([Call((torch.ones(2, 3),), {})], [2])
    stage = StageModule(nn.Linear(3, 3), 1, 2, lambda body, a, k, r, f, last: {"y": body(r[0]), "tag": "x"})
    stage.step = step
    tensors = stage(torch.ones(2, 3), microbatch=0)
    assert isinstance(tensors, tuple) and tensors[0].requires_grad  # autograd graph kept for the loss
    assert step.final_output(0, tensors)["tag"] == "x"


def test_a_plain_last_stage_finds_no_model_to_count_once_and_records_nothing():
    step = StepContext([Call((torch.ones(2, 3),), {})] * 2, [2, 2])
    stage = StageModule(nn.Linear(3, 3), 1, 2, lambda body, a, k, r, f, last: body(r[0]))
    assert stage.loss_candidates is None
    stage.step = step
    stage(torch.ones(2, 3), microbatch=0)
    found = stage.loss_candidates
    stage(torch.ones(2, 3), microbatch=1)
    assert found == [] and stage.loss_candidates is found and step.counted == {}
    assert "loss_candidates" not in stage.state_dict() and len(list(stage.modules())) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_one_microbatch_loss_is_the_step_loss_bit_for_bit(dtype):
    loss = torch.tensor(1.0 / 3.0, dtype=dtype)
    for weights in ([1.0], [7.0]):
        merged = _weighted_mean([loss], weights)
        assert merged.dtype == dtype and torch.equal(merged, loss)
    two = _weighted_mean([loss, loss * 2], [1.0, 3.0])  # several microbatches: the float64 weighted mean
    assert torch.equal(two, ((loss.double() * 1 + loss.double() * 2 * 3) / 4).to(dtype))


# ---------------------------------------------------------------------------------------------------- sharing
def test_outcome_encoding_round_trips_and_keeps_the_schema_when_only_values_change():
    def outcome(loss: float, count: int) -> Outcome:
        update = MetricUpdate("acc", count, tensors={"tp": torch.tensor([count, 2])}, forward_value=torch.tensor(0.5))
        logs = [LoggedValue("loss", torch.tensor(loss), {"prog_bar": True}), LoggedValue("acc", MetricRef("acc"))]
        return Outcome(loss=torch.tensor(loss), logs=logs, metric_updates=[update], output={"n": count})

    schema, values = flatten(outcome(1.5, 3))
    again, _ = flatten(outcome(2.5, 4))
    assert schema == again  # steady state: only the values tensor travels
    flat = torch.cat([torch.as_tensor(v, dtype=torch.float64).reshape(-1) for v in values])
    back = rebuild(schema, flat, torch.device("cpu"))
    assert float(back.loss) == 1.5 and back.logs[0].kwargs == {"prog_bar": True} and back.logs[1].value.name == "acc"
    assert back.metric_updates[0].tensors["tp"].dtype == torch.int64 and back.output == {"n": 3}
    assert flatten({"big": torch.tensor([2**60])})[0] is None  # not exact in float64: sent as an object


def test_empty_and_nested_containers_keep_their_types_through_the_encoding():
    output = {"none": None, "list": [], "tuple": (), "flag": False, "nested": [(1, 2.5), {"k": torch.ones(2)}]}
    schema, values = flatten(Outcome(loss=torch.tensor(0.5), output=output, output_shared=True))
    flat = torch.cat([torch.as_tensor(v, dtype=torch.float64).reshape(-1) for v in values])
    back = rebuild(schema, flat, torch.device("cpu"))
    assert type(back.output["list"]) is list and type(back.output["tuple"]) is tuple and back.logs == []
    assert back.output["nested"][0] == (1, 2.5) and type(back.output["nested"][0][0]) is int
    assert torch.equal(back.output["nested"][1]["k"], torch.ones(2)) and back.output["flag"] is False


def test_values_pack_bit_for_bit_as_a_conversion_to_float64_would():
    """The values of a step travel as one float64 tensor; numbers and small CPU tensors are gathered as Python floats
    (one tensor operation): the same bits as converting each to float64, for every dtype the schema lets through."""
    from lightning_pipe.step.sharing import _GATHERED, _READ_AS_NUMBERS, _pack_values

    g = torch.Generator().manual_seed(0)
    values = [
        torch.randn((), generator=g),  # a loss
        torch.randn(3, generator=g).to(torch.bfloat16),
        torch.randn(2, 2, generator=g).to(torch.float16),
        torch.tensor([2**53, -(2**53), 7]),  # the largest integers float64 holds exactly
        torch.tensor([True, False]),
        torch.randn(_GATHERED + 1, generator=g, dtype=torch.float64),  # larger: converted as a tensor
        torch.tensor(float("inf")),
        3,
        0.1,
        True,
    ]
    expected = torch.cat(
        [
            v.reshape(-1).to(torch.float64)
            if isinstance(v, torch.Tensor)
            else torch.tensor([float(v)], dtype=torch.float64)
            for v in values
        ]
    )
    packed = _pack_values(values, torch.device("cpu"), flag=1.0)
    assert packed.dtype == torch.float64 and packed[0] == 1.0
    assert torch.equal(packed[1:].view(torch.int64), expected.view(torch.int64))
    assert torch.equal(_pack_values(values, torch.device("cpu")).view(torch.int64), expected.view(torch.int64))
    assert _pack_values([], torch.device("cpu")).shape == (0,)
    # and back: the receiver's scalars are made from Python floats, larger tensors sliced; both give the same bits
    for flat in (packed[1:], torch.cat([packed[1:], torch.zeros(_READ_AS_NUMBERS)])):  # small, then sliced
        schema, _ = flatten(values)
        back = rebuild(schema, flat, torch.device("cpu"))
        for got, sent in zip(back, values):
            if isinstance(sent, torch.Tensor):
                assert got.dtype == sent.dtype and got.shape == sent.shape
                assert torch.equal(
                    got.reshape(-1).double().view(torch.int64), sent.reshape(-1).double().view(torch.int64)
                )
            else:
                assert type(got) is type(sent) and got == sent


# ---------------------------------------------------------------------------------------------------- mesh
def test_mesh_layout_places_ranks():
    inner_pp, inner_dp = MeshLayout(2, 3, "pp"), MeshLayout(2, 3, "dp")
    assert inner_pp.pipeline_ranks(1) == [2, 3] and inner_pp.replica_ranks(0) == [0, 2, 4]
    assert inner_dp.pipeline_ranks(1) == [1, 4] and inner_dp.replica_ranks(0) == [0, 1, 2]
    assert all(inner_pp.rank(*inner_pp.coordinates(r)) == r for r in range(6))
    with pytest.raises(PipelineConfigError, match="`inner_axis='x'` is not one of 'dp', 'pp'"):
        MeshLayout(2, 2, "x")  # type: ignore[arg-type]


def test_device_mesh_exists_only_once_processes_start():
    with pytest.raises(PipelineUsageError, match=r"device mesh.*when the processes start.*\(setup_environment\)"):
        _ = PipelineParallelStrategy().device_mesh


# ---------------------------------------------------------------------------------------------------- NCCL placement
@pytest.mark.parametrize(
    "backend,types",
    [("cpu:gloo,cuda:nccl", {"cpu", "cuda"}), ("nccl", {"cuda"}), ("gloo", {"cpu"}), ("NCCL", {"cuda"})],
)
def test_backends_serve_their_device_types(backend, types):
    from lightning_pipe.comm import collectives

    assert collectives.served_device_types(backend) == types


def test_tensors_go_where_the_backend_serves_them(monkeypatch):
    """A CPU tensor sent over a pure NCCL group goes to the current CUDA device (NCCL rejects CPU tensors); a CUDA
    tensor over gloo goes to the CPU; a device the backend serves stays. Checked without a GPU by faking the group."""
    from lightning_pipe.comm import collectives

    monkeypatch.setattr(collectives, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    for backend, preferred, expected in [
        ("nccl", cpu, torch.device("cuda", 1)),
        ("nccl", cuda, cuda),
        ("gloo", cuda, cpu),
        ("gloo", cpu, cpu),
        ("cpu:gloo,cuda:nccl", cpu, cpu),
        ("cpu:gloo,cuda:nccl", cuda, cuda),
    ]:
        monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None, b=backend: b)
        assert collectives.served_device(None, preferred) == expected, (backend, preferred)


def test_the_default_backend_on_cuda_serves_cpu_tensors_too():
    from lightning_pipe.comm.collectives import default_backend

    assert default_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert default_backend(torch.device("cpu")) == "gloo"


def test_a_stage_posting_a_receive_tells_the_step_where_the_rank_waits():
    # The outcome channel posts its receive there (StepContext.on_receive), not before the first forward; a send, or
    # a receive with no operation (the neighbour on the same rank), tells nothing; only the first receive tells.
    from types import SimpleNamespace

    from lightning_pipe.step.stage import _posted

    told: list[int] = []
    module = StageModule(nn.Linear(2, 2), 0, 2, call_with_activation)
    module.on_receive = lambda: told.append(1)
    stage = SimpleNamespace(submod=module, stage_index=0)
    op = object()
    assert _posted(stage, [op], "send", "B", 0) == [op] and told == []
    assert _posted(stage, [], "recv", "B", 0) == [] and told == []
    assert _posted(stage, [op], "recv", "B", 0) == [op] and told == [1]
    assert module.on_receive is None  # told once a step: the stage's later receives tell nothing
    assert _posted(stage, [op], "recv", "F", 1) == [op] and told == [1]


def test_a_stage_runs_torch_own_methods_unless_a_step_needs_its_reports():
    # The reports (timeline, the outcome's receive, a split backward run whole) are instance attributes over torch's
    # methods while needed: without them, torch's own run on every microbatch with no call of ours around them.
    from torch.distributed.pipelining import PipelineStage

    from lightning_pipe.step.stage import _StageActions, chunk_aware_stage_class, watch
    from tests.groups import one_rank_group

    names = ["get_fwd_recv_ops", "get_bwd_recv_ops", "get_fwd_send_ops", "get_bwd_send_ops", "backward_one_chunk"]
    names.append("backward_weight_one_chunk")
    with one_rank_group():
        module = StageModule(nn.Linear(2, 2), 0, 1, call_with_activation)
        stage = chunk_aware_stage_class()(module, 0, 1, torch.device("cpu"))
        assert all(getattr(type(stage), n) is getattr(PipelineStage, n) for n in names)
        assert stage.watching == frozenset() and not set(names) & set(vars(stage))

        module.on_receive = lambda: None
        watch(stage)
        assert stage.watching == {"receives"} and set(names) & set(vars(stage)) == set(names[:2])
        assert stage.get_fwd_recv_ops.__func__ is _StageActions.watched_fwd_recv

        module.recorder = object()
        watch(stage)
        assert stage.watching == {"receives", "sends", "backwards"} and set(names) <= set(vars(stage))
        assert stage.backward_weight_one_chunk.__func__ is _StageActions.watched_weight

        module.on_receive = module.recorder = None
        watch(stage)
        assert stage.watching == frozenset() and not set(names) & set(vars(stage))

        # a stage call that runs some split backwards whole (the dataflow frontend): its backwards always
        def splitting(*args):
            return call_with_activation(*args)

        splitting.full_backward = lambda index: False
        module = StageModule(nn.Linear(2, 2), 0, 1, splitting)
        stage = chunk_aware_stage_class()(module, 0, 1, torch.device("cpu"))
        assert stage.watching == {"backwards"} and set(names) & set(vars(stage)) == set(names[4:])


def test_the_usual_training_step_settles_as_the_checks_would():
    # A step whose every microbatch returned a bare loss with nothing counted settles without the checks for items:
    # the same loss, output and logs as the general path (microbatches of 3 and 1 samples, weighted by size).
    from types import SimpleNamespace

    from lightning_pipe.step.protocol import StepProtocol, _Record

    metrics = SimpleNamespace(settle=lambda: None, step_value_of=lambda value: (False, None), updates=lambda: [])
    user_step = SimpleNamespace(hook="training_step", name="training_step")

    def settled(bare: int) -> Outcome:
        record = _Record(bare=bare)
        for m, value in enumerate([1.0, 5.0]):
            loss = torch.tensor(value, requires_grad=True) * 1.0
            record.losses[m] = record.results[m] = loss
            record.logs[m] = [LoggedValue("train_loss", loss, {"prog_bar": True})]
        return StepProtocol._settle(None, user_step, record, [3, 1], metrics, 7)  # type: ignore[arg-type]

    usual, general = settled(bare=2), settled(bare=0)
    assert usual.loss.item() == general.loss.item() == 2.0 and not usual.loss.requires_grad
    assert usual.output is usual.loss and general.output is general.loss and usual.grad_scale is general.grad_scale
    assert [(e.name, e.value.item(), e.kwargs) for e in usual.logs] == [("train_loss", 2.0, {"prog_bar": True})]
    assert [(e.name, e.value.item(), e.kwargs) for e in general.logs] == [("train_loss", 2.0, {"prog_bar": True})]
