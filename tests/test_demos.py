"""Lightning's own demo LightningModules (``lightning.pytorch.demos``) under ``strategy="pipeline"``: the one-Linear
demos (``BoringModel``, ``DemoModel``) run as one unit on the first stage, the other stages passing its output on, with
a warning that names the fix; what cannot run is refused by name. (Their 2-process parity, and the demo transformer's:
tests/test_project.py.)"""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch.demos import BoringModel, DemoModel
from torch import nn

from lightning_pipe.checkpoint.io import model_state
from lightning_pipe.errors import PipelineConfigError, PipelineModelError
from lightning_pipe.models.units import ONE_UNIT, find_layout
from lightning_pipe.parallel.grads import STAND_IN, build_optimizers
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.split.builder import split_module
from lightning_pipe.split.frontend import choose_frontend
from lightning_pipe.split.surgery import PassOn

CPU = torch.device("cpu")


def _split(module: nn.Module, rank: int, **settings):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = split_module(module, PipelineSettings(**settings).resolve(2), pipeline_rank=rank, device=CPU)
    return split, [str(w.message) for w in caught if "one unit" in str(w.message)]


@pytest.mark.parametrize(("demo", "attr"), [(BoringModel, "layer"), (DemoModel, "l1")])
def test_a_one_linear_demo_is_one_unit_that_the_first_stage_runs_and_the_second_passes_on(demo, attr):
    assert find_layout(demo().get_submodule(attr)) == ONE_UNIT
    model = demo()
    weight = model.get_submodule(attr).weight
    first, said = _split(model, 0)
    assert first.units_per_stage == [("",), ()] and first.network_attr == attr
    assert first.bodies[0].weight is weight and set(model.state_dict()) == {f"{attr}.weight", f"{attr}.bias"}
    # The stage without the unit holds none of its state: nothing to checkpoint, nothing to step.
    model = demo()
    second, said_too = _split(model, 1)
    assert isinstance(second.bodies[1], PassOn) and model.state_dict() == {} and not list(model.parameters())
    assert said == said_too and len(said) == 1
    assert "Linear" in said[0] and f"`{attr}`" in said[0]
    assert "2 stages" in said[0] and "1 of the 2 pipeline processes are held for nothing" in said[0]
    assert "`devices=1`" in said[0] and "strategy='ddp'" in said[0]


def test_the_pass_on_stage_returns_the_activation_and_hands_a_contiguous_gradient_back():
    model = BoringModel()
    call = _split(model, 1)[0].stage_call
    received = torch.randn(3, 2, requires_grad=True)
    out = call(PassOn(), (torch.zeros(3, 32),), {}, (received,), False, True)
    assert torch.equal(out, received)
    out.sum().backward()  # sum's gradient is an expanded tensor; torch receives gradients into contiguous buffers
    assert received.grad.is_contiguous() and torch.equal(received.grad, torch.ones(3, 2))
    pair = call(PassOn(), (), {}, (received, torch.arange(3)), False, False)
    assert isinstance(pair, tuple) and torch.equal(pair[1], torch.arange(3))


def test_frontend_auto_picks_modules_for_a_one_unit_network_and_says_why():
    chosen, why = choose_frontend(nn.Linear(4, 2), "auto", 1, False)
    assert chosen == "modules" and "Linear is one module with no submodules" in why


@pytest.mark.parametrize(
    ("settings", "named"),
    [({"balance": [1, 1]}, "`balance=[1, 1]`"), ({"split_points": ["x"]}, "`split_points=['x']`")],
)
def test_placing_a_one_unit_network_by_hand_is_refused_naming_the_argument(settings, named):
    with pytest.raises(
        PipelineConfigError, match=r"`layer`, a Linear.*no submodules.*`split_points`.*`balance`.*`devices=1`"
    ) as info:
        _split(BoringModel(), 0, **settings)
    assert named in str(info.value) and "`devices=1`" in str(info.value)


@pytest.mark.parametrize("frontend", ["dataflow", "trace"])
def test_the_frontends_that_cut_between_submodules_refuse_a_one_unit_network_naming_the_modules_frontend(frontend):
    model = DemoModel()
    model.example_input_array = torch.randn(4, 32)
    with pytest.raises(PipelineModelError, match=r"a single Linear.*no submodules.*`frontend='modules'`.*`devices=1`"):
        _split(model, 0, frontend=frontend)


def test_a_rank_without_parameters_builds_the_users_optimizer_and_scheduler_with_empty_groups():
    network = nn.Linear(2, 2)
    for name in ("weight", "bias"):
        delattr(network, name)  # as the pass-on stage's rank holds it
    module = nn.Module()
    module.layer = network
    built: list = []

    def setup() -> None:
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)  # torch refuses an empty parameter list
        built.extend([optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)])

    build_optimizers(network, module, setup, lambda: built[:1])
    optimizer, scheduler = built
    assert optimizer.param_groups[0]["params"] == [] and not hasattr(network, STAND_IN)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)  # the schedule steps as on every rank
    assert model_state(module) == {}  # torch's get_model_state_dict refuses an empty module; the shard is empty


def test_a_lightning_module_without_parameters_is_refused():
    class NoParameters(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.ReLU()

    with pytest.raises(
        PipelineModelError, match=r"NoParameters has no submodule.*parameters to pipeline.*`configure_model`"
    ):
        _split(NoParameters(), 0)


def test_a_resumed_group_without_parameters_here_reads_the_saved_hyperparameters_of_its_full_model_group():
    from lightning_pipe.checkpoint import optim

    def empty() -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD([nn.Parameter(torch.empty(0))], lr=0.1, momentum=0.5)
        optimizer.param_groups[0]["params"] = []  # as build_optimizers leaves a rank without parameters
        return optimizer

    flat = {"param_groups.layer.weight.lr": 0.001, "param_groups.layer.weight.momentum": 0.9}
    optimizer = empty()
    optimizer.load_state_dict(optim.unflatten(optimizer, {}, flat, {0: "layer.weight"}))
    assert optimizer.param_groups[0]["lr"] == 0.001 and optimizer.param_groups[0]["momentum"] == 0.9
    optimizer = empty()
    optimizer.load_state_dict(optim.unflatten(optimizer, {}, flat))  # no parameter named: its own values stay
    assert optimizer.param_groups[0]["lr"] == 0.1
    assert set(optim.target(optimizer, {}, {k: None for k in flat}, {0: "layer.weight"})) == set(flat)


@pytest.mark.parametrize("frontend", ["auto", "modules", "dataflow"])
def test_the_lstm_demo_is_refused_naming_its_one_multi_layer_lstm(frontend):
    """Lightning's demo LightningLSTM: its 4 layers are one nn.LSTM, which a pipeline cannot cut; the message names
    the module, its layers and the two ways out."""
    from lightning.pytorch.demos.lstm import SimpleLSTM

    network = SimpleLSTM(vocab_size=16, ninp=8, nhid=8, nlayers=3)
    with pytest.raises(PipelineModelError) as raised:
        _split(network, 0, frontend=frontend)
    message = str(raised.value)
    assert "SimpleLSTM's repeated layers are inside one LSTM (`rnn`, num_layers=3)" in message
    assert "nn.ModuleList of one-layer LSTM modules" in message and "`devices=1`" in message
    assert "strategy='ddp'" in message
