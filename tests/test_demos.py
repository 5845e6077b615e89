"""Lightning's own demo LightningModules (``lightning.pytorch.demos``) under ``strategy="pipeline"``: what cannot be
pipelined is refused by name, with the fix. (The demo transformer: see docs/getting-started.md.)"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.demos import BoringModel, DemoModel
from lightning.pytorch.demos.boring_classes import ManualOptimBoringModel

from lightning_pipe import PipelineParallelStrategy
from lightning_pipe.errors import PipelineModelError, PipelineUsageError
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.split.builder import split_module
from tests.models import quiet_trainer


@pytest.mark.parametrize("demo", [BoringModel, DemoModel])
def test_a_demo_whose_network_is_one_linear_is_refused_with_devices_1_as_the_fix(demo):
    settings = PipelineSettings().resolve(2)
    with pytest.raises(PipelineModelError, match=r"single Linear with no submodules.*`devices=1`.*strategy='ddp'"):
        split_module(demo(), settings, pipeline_rank=0, device=torch.device("cpu"))


def test_the_manual_optimization_demo_is_refused_naming_automatic_optimization():
    trainer = quiet_trainer(strategy=PipelineParallelStrategy(), devices=1, max_steps=1)
    with pytest.raises(PipelineUsageError, match=r"needs automatic optimization.*automatic_optimization = False"):
        trainer.fit(ManualOptimBoringModel())
