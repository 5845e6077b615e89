"""Both front ends take one argument list: the signatures of the Trainer and Fabric strategies and the fields of
``PipelineSettings`` agree on names, order, defaults and annotations; the Fabric strategy refuses the Trainer-only
arguments by name."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Optional

import pytest

from lightning_pipe import PipelineConfigError, PipelineFabricStrategy, PipelineParallelStrategy
from lightning_pipe.fabric import TRAINER_ONLY
from lightning_pipe.session import PipelineArguments
from lightning_pipe.settings import PipelineSettings, argument_names


def disagreements(cls: type) -> list[str]:
    """How the constructor of ``cls`` differs from the fields of :class:`PipelineSettings`."""
    parameters = [p for p in inspect.signature(cls).parameters.values() if p.name != "self"]
    names = [p.name for p in parameters]
    found = [] if names == list(argument_names()) else [f"names {names} != {list(argument_names())}"]
    fields = {f.name: f for f in dataclasses.fields(PipelineSettings)}
    hints = typing.get_type_hints(PipelineSettings)
    theirs = typing.get_type_hints(cls.__init__)
    for p in parameters:
        if p.name not in fields:
            continue
        if p.default != fields[p.name].default:
            found.append(f"{p.name}: default {p.default!r} != {fields[p.name].default!r}")
        if theirs.get(p.name) != hints[p.name]:
            found.append(f"{p.name}: annotation {theirs.get(p.name)} != {hints[p.name]}")
    return found


@pytest.mark.parametrize("cls", [PipelineParallelStrategy, PipelineFabricStrategy])
def test_signature_is_the_settings(cls):
    assert disagreements(cls) == []


def test_the_check_sees_a_signature_that_drifted():
    class Drifted(PipelineArguments):
        def __init__(self, pipeline_size: Optional[str] = "all", schedule: str = "auto") -> None:
            pass

    found = disagreements(Drifted)
    assert any(f.startswith("names") for f in found)
    assert any(f.startswith("pipeline_size: default") for f in found)
    assert any(f.startswith("pipeline_size: annotation") for f in found)
    assert any(f.startswith("schedule: annotation") for f in found)


def test_settings_are_built_field_by_field():
    """Every argument reaches the settings (none dropped on the way)."""
    values = {
        "pipeline_size": 2,
        "schedule": "gpipe",
        "microbatches": 4,
        "module": "net",
        "blocks": "layers",
        "balance": [1, 1],
        "process_group_backend": "gloo",
        "timeout": None,
        "eval_microbatches": 3,
        "data_parallel": "fsdp",
        "inner_axis": "pp",
        "init_values": "per_unit",
        "activation_checkpointing": 2,
        "model_plan": {"model.layers": (["h"], ["h"])},
    }
    for cls in (PipelineParallelStrategy, PipelineFabricStrategy):
        settings = cls(**values).settings
        assert settings.schedule == "GPipe" and settings.balance == (1, 1)
        for name in set(values) - {"schedule", "balance"}:
            assert getattr(settings, name) == values[name], (cls, name)


@pytest.mark.parametrize("name,value", [("tensor_parallel", 2), ("loss_parallel", True), ("max_restarts", 1)])
def test_fabric_refuses_trainer_only_arguments(name, value):
    with pytest.raises(PipelineConfigError, match=rf"`{name}={value!r}`.*Fabric.*default.*Trainer"):
        PipelineFabricStrategy(**{name: value})
    assert name in TRAINER_ONLY


def test_fabric_refuses_async_checkpoint_and_accepts_defaults():
    with pytest.raises(PipelineConfigError, match=r"`async_checkpoint=True`.*checkpoints"):
        PipelineFabricStrategy(async_checkpoint=True)
    assert PipelineFabricStrategy(tensor_parallel=1, loss_parallel=False).settings.tensor_parallel == 1
