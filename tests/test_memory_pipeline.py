"""Meta-device construction under the pipeline: the model's own init whatever the layout (2 and 4 processes, and one
process with ``pipeline_size=1``), and each rank holding about 1/K of the model and its optimizer state, having
allocated only its own stages."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from tests.launch import SHARED_FOUR, SHARED_TWO, Launch
from tests.memory_models import run_meta
from tests.reference import merged_state

FAMILIES = ["gpt2", "llama", "free", "loop"]
CONFIGS = {
    2: [{"name": f"{f}-2", "family": f, "devices": 2} for f in FAMILIES],
    4: [{"name": f"{f}-4", "family": f, "devices": 4} for f in FAMILIES],
}


@functools.cache
def one_process(family: str) -> dict:
    if family == "llama":
        pytest.importorskip("transformers")
    return run_meta(family, devices=1)


SHARED_FOUR.part(__name__, "four", "memory_init.py", CONFIGS[4])
SHARED_TWO.part(__name__, "two", "memory_init.py", CONFIGS[2])


@pytest.fixture(scope="module")
def two(request) -> Launch:
    pytest.importorskip("transformers")
    return SHARED_TWO.launch(request)  # the 2-process launch shared with other modules (tests/launch.py Shared)


@pytest.fixture(scope="module")
def four(request) -> Launch:
    pytest.importorskip("transformers")
    return SHARED_FOUR.launch(request)  # the 4-process launch shared with other modules (tests/launch.py Shared)


@pytest.fixture(scope="module")
def launched(two, four) -> dict[int, Launch]:
    """The 2- and 4-process launches by process count; each test reads its own config's outcome (Launch.ranks)."""
    return {2: two, 4: four}


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [2, 4])
def test_initial_weights_do_not_depend_on_the_layout(launched, family, k):
    ranks = launched[k].ranks(f"{family}-{k}")
    whole = one_process(family)["state"]
    state = merged_state(ranks)
    assert state.keys() == whole.keys()
    for key in whole:
        # The same per-module seeds and the same init ops on the same machine: bitwise equal.
        assert torch.equal(state[key], whole[key]), key


def test_the_model_s_own_init_is_used():
    """GPT-2's `_init_weights`: N(0, 0.02), residual projections N(0, 0.02/sqrt(2 n_layer)) (PyTorch's default init
    for these Linear layers would have std ~0.07-0.1)."""
    state = one_process("gpt2")["state"]
    assert abs(state["model.h.0.attn.c_attn.weight"].std().item() - 0.02) < 0.002
    assert abs(state["model.wte.weight"].std().item() - 0.02) < 0.002
    assert abs(state["model.h.3.mlp.c_proj.weight"].std().item() - 0.02 / math.sqrt(16)) < 0.0008
    assert torch.all(state["model.h.0.attn.c_attn.bias"] == 0) and torch.all(state["model.ln_f.weight"] == 1)


@pytest.mark.parametrize("family", ["free", "loop"])
def test_init_written_as_a_free_function_or_a_loop_is_replayed(family):
    """`apply(gpt2_init)` and a loop of `nn.init` / `p.data.normal_()` / `fill_` calls in `configure_model` give the
    model's distribution, not PyTorch's defaults (Linear(64, 192) would have std 0.072)."""
    state = one_process(family)["state"]
    for name, value in state.items():
        if name.endswith("c_proj.weight"):
            assert abs(value.std().item() - 0.02 / math.sqrt(16)) < 0.0008, name
        elif value.dim() == 2:
            assert abs(value.std().item() - 0.02) < 0.002, name
        elif name.endswith("bias"):
            assert torch.all(value == 0), name
        else:
            assert torch.all(value == 1), name


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4])
def test_each_rank_holds_its_share(launched, k):
    whole = one_process("gpt2")
    total = whole["parameters"] + whole["optimizer_state"]
    for rank in launched[k].ranks(f"gpt2-{k}"):
        held = rank["parameters"] + rank["optimizer_state"]
        assert held <= total / k * 1.10, (held, total / k)
        # Construction allocated this rank's stages and little else: never another stage's parameters.
        assert rank["construction_peak"] is not None
        assert rank["parameters"] <= rank["construction_peak"] <= rank["parameters"] * 1.10 + 2**20
        assert rank["saved"] and all(v > 0 for v in rank["saved"].values())
