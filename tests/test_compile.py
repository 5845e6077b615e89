"""``compile=True``: blocks compiled in place, exact against eager one-device training; refused schedules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe import PipelineConfigError, PipelineParallelStrategy
from lightning_pipe.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_pipe.parallel.compile import (
    apply_compile,
    check_compiler,
    compiled_blocks,
    remove_compile,
    stage_device,
)
from lightning_pipe.parallel.wrappers import unwrap_stages
from lightning_pipe.settings import SPLIT_BACKWARD, PipelineSettings
from tests.launch import Launch, run_scenarios
from tests.reference import assert_parity, single_device_run

# Inductor compiles C++ in a pool of worker processes by default; one worker keeps two ranks on a busy machine from
# oversubscribing it (the compiled code is the same).
COMPILE_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
CONFIGS = [
    {"name": "GPipe-compile", "schedule": "GPipe", "devices": 2, "n_layers": 4, "compile": True},
    {
        "name": "1F1B-compile-ac",
        "schedule": "1F1B",
        "devices": 2,
        "n_layers": 4,
        "compile": True,
        "activation_checkpointing": True,
    },
]


@pytest.mark.parametrize("schedule", sorted(SPLIT_BACKWARD))
def test_refused_schedules_raise_before_any_process_starts(schedule):
    with pytest.raises(PipelineConfigError, match=rf"`compile` cannot be used with `schedule='{schedule}'`") as err:
        PipelineParallelStrategy(schedule=schedule, compile=True)
    assert "single node that computes both" in str(err.value)
    assert "'GPipe', '1F1B', 'Interleaved1F1B' or 'LoopedBFS'" in str(err.value)


def test_refused_schedule_set_is_torchs():
    """The schedules torch 2.13 checks for compiled stages (``_check_torch_compile_compatibility``) are ours."""
    import inspect

    from torch.distributed.pipelining import schedules

    source = inspect.getsource(schedules)
    checked = set()
    for name in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", *SPLIT_BACKWARD):
        cls = schedules.get_schedule_class(name)
        if "_check_torch_compile_compatibility(" in inspect.getsource(cls):
            checked.add(name)
    assert "_check_torch_compile_compatibility" in source
    assert checked == set(SPLIT_BACKWARD)


@pytest.mark.parametrize(
    "value, message",
    [
        ("yes", "must be True, False or a dict of torch.compile options"),
        ({"fullgraph": True, "model": 1}, r"options torch.compile does not take per block: \['model'\]"),
    ],
)
def test_bad_compile_values(value, message):
    with pytest.raises(PipelineConfigError, match=message):
        PipelineSettings(compile=value)


def test_compile_settings_normalised():
    assert PipelineSettings().compile is None
    assert PipelineSettings(compile=False).compile is None
    assert PipelineSettings(compile=True).compile == {}
    assert PipelineSettings(compile={"mode": "max-autotune-no-cudagraphs"}).compile == {
        "mode": "max-autotune-no-cudagraphs"
    }


def test_missing_cpp_compiler_is_named(monkeypatch):
    import lightning_pipe.parallel.compile as compile_module

    monkeypatch.setattr(compile_module.shutil, "which", lambda name: None)
    with pytest.raises(PipelineConfigError, match="needs a C\\+\\+ compiler"):
        check_compiler({}, torch.device("cpu"))
    check_compiler({"backend": "aot_eager"}, torch.device("cpu"))  # no C++ needed


def test_missing_cpp_compiler_is_named_by_wrap_stages_on_the_stages_device(monkeypatch):
    """wrap_stages checks the compiler for the device the stages' parameters were moved to (no C++ on a meta device:
    that check is the CPU's)."""
    import lightning_pipe.parallel.compile as compile_module
    from lightning_pipe.parallel.wrappers import wrap_stages

    monkeypatch.setattr(compile_module.shutil, "which", lambda name: None)
    assert stage_device({0: nn.Module()}) == torch.device("cpu")  # no parameters: the CPU
    with pytest.raises(PipelineConfigError, match="needs a C\\+\\+ compiler"):
        wrap_stages(
            {0: _stage()}, ["layers.1"], checkpoint_every=0, compile_options={}, dp_mesh=None, sharded_over=None
        )
    on_meta = _stage().to("meta")
    assert stage_device({0: on_meta}) == torch.device("meta")
    done = wrap_stages(
        {0: on_meta}, ["layers.1"], checkpoint_every=0, compile_options={}, dp_mesh=None, sharded_over=None
    )
    assert done.compiled == ["layers.1"]
    unwrap_stages({0: on_meta})


def _stage() -> nn.Module:
    stage = nn.Module()
    stage.body = nn.Module()
    stage.body.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    stage.body.layers[0] = None  # another stage's block
    return stage


def test_apply_and_remove_keep_names_and_restore_forwards():
    stage = _stage()
    names = [n for n, _ in stage.named_parameters()]
    apply_activation_checkpointing(stage, ["body.layers.0", "body.layers.1", "body.layers.2"], 2)
    checkpointed = stage.body.layers[1].forward
    done = apply_compile(stage.get_submodule("body"), ["layers.0", "layers.1", "layers.2"], {"backend": "eager"})
    assert done == ["layers.1", "layers.2"]
    assert compiled_blocks(stage.body) == ["layers.1", "layers.2"]
    assert [n for n, _ in stage.named_parameters()] == names  # no `_orig_mod` anywhere
    assert stage.body.layers[1].forward is not checkpointed
    apply_compile(stage.get_submodule("body"), ["layers.1"], {"backend": "eager"})  # twice: nothing more
    x = torch.randn(2, 4)
    torch.testing.assert_close(stage.body.layers[2](x), nn.functional.linear(x, *stage.body.layers[2].parameters()))
    unwrap_stages({0: stage})  # compile first, then activation checkpointing
    assert compiled_blocks(stage) == []
    assert all("forward" not in vars(m) for m in stage.modules())


def test_a_stage_without_named_blocks_is_compiled_whole():
    body = nn.Sequential(nn.Linear(2, 2))
    assert apply_compile(body, ["layers.0"], {"backend": "eager"}) == [""]
    remove_compile(body)
    assert "forward" not in vars(body)


@pytest.fixture(scope="module")
def compiled_runs(tmp_path_factory) -> Launch:
    out = tmp_path_factory.mktemp("compile")
    return run_scenarios("parity.py", out, CONFIGS, nprocs=2, launcher="lightning", env=COMPILE_ENV, timeout=900)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c["name"])
def test_compiled_stages_match_eager_one_device(compiled_runs, cfg):
    ranks = compiled_runs.ranks(cfg["name"])
    assert len(ranks) == 2
    # rtol 1e-5 against eager training on one device (inductor fuses and reorders float operations)
    assert_parity(ranks, *single_device_run(n_layers=4))
    assert sorted(b for r in ranks for b in r["compiled"]) == [f"layers.{i}" for i in range(4)]
    if cfg.get("activation_checkpointing"):
        assert sorted(b for r in ranks for b in r["checkpointed"]) == [f"layers.{i}" for i in range(4)]
    assert all(r["forwards_left"] == [] for r in ranks)  # teardown gave every block its own forward back
