"""``frontend="auto"``: the frontend chosen per network, and why (pure; no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.settings import PipelineSettings
from lightning_pipe.split.builder import split_module
from lightning_pipe.split.frontend import choose_frontend
from tests.crossing_models import UNet
from tests.models import TinyLM
from tests.template_models import SimpleDenseNet, new_module


class _ChecksOtherAttributes(nn.Module):
    """Tests an attribute that is not a unit against None: says nothing about skipping units."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = None
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            self.cache = 0
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize(
    ("network", "chosen", "why"),
    [
        (nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), "modules", "is an nn.Sequential"),
        (TinyLM(n_layers=2), "modules", "TinyLM.forward tests its units against None"),
        (SimpleDenseNet(), "dataflow", "SimpleDenseNet.forward calls its units without None checks"),
        (UNet(), "dataflow", "UNet.forward calls its units without None checks"),
        (_ChecksOtherAttributes(), "dataflow", "without None checks"),
    ],
)
def test_auto_chooses_by_what_the_forward_can_run(network, chosen, why):
    found, reason = choose_frontend(network, "auto", 1, several_stacks=False)
    assert found == chosen and why in reason


def test_auto_gives_way_to_tensor_parallelism_several_stacks_and_an_explicit_frontend():
    chosen, why = choose_frontend(SimpleDenseNet(), "auto", 2, False)
    assert chosen == "modules" and why.startswith("`tensor_parallel=2` needs the modules frontend (the dataflow")
    assert "SimpleDenseNet.forward must skip the units other stages hold" in why
    assert "tests none of its units against None" in why
    assert choose_frontend(TinyLM(n_layers=2), "auto", 2, False) == (
        "modules",
        "`tensor_parallel=2` needs the modules frontend",
    )
    assert choose_frontend(TinyLM(n_layers=2), "auto", 1, True)[0] == "dataflow"
    assert choose_frontend(SimpleDenseNet(), "modules", 1, False) == ("modules", "`frontend='modules'` was given")


def test_the_cut_resolves_auto_and_says_so_once():
    said: list[str] = []
    settings = PipelineSettings().resolve(2)
    split = split_module(new_module(), settings, pipeline_rank=1, device=torch.device("cpu"), announce=said.append)
    assert "'dataflow'" in split.described and settings.frontend == "auto"
    (line,) = [text for text in said if "frontend" in text]
    assert line.startswith("lightning-pipe: `frontend='auto'` chose 'dataflow': SimpleDenseNet.forward calls")
    # the stage runs the unchanged forward on the previous stage's output (no unpacking error)
    assert type(split.network.model[0]).__name__ == "StandIn"


def test_a_stage_failure_under_tensor_parallelism_points_to_none_checks_not_to_dataflow(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from lightning_pipe.step.interception import Call
    from lightning_pipe.step.stage import StageModule

    def note(body: nn.Module) -> str:
        stage = StageModule(body, 1, 2, stage_call=None, absent_units=("embed",))
        return stage.describe_failure(Call(args=(torch.zeros(1, 2),), kwargs={}), (torch.zeros(1, 2),), 0)

    plain = note(nn.Linear(2, 2))
    assert "Units held by other stages are absent (None) here: embed." in plain
    assert "runs unchanged with `frontend='dataflow'`" in plain
    owned = not dist.is_initialized()  # an earlier one-process test may have left its group up
    if owned:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        body = parallelize_module(
            nn.Linear(2, 2), init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)), ColwiseParallel()
        )
        split = note(body)
    finally:
        if owned:
            dist.destroy_process_group()
    assert "(e.g. `if self.embed is not None:`)" in split
    assert "With tensor parallelism it must: the dataflow frontend" in split and "does not take" in split
    assert "frontend='dataflow'`." not in split
