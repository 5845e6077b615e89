"""Cost-balanced splits: the exact splitter, the params split, the profiler and the split table."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.models.units import find_layout
from lightning_pipe.split.balance import (
    CostModel,
    UnitProfile,
    auto_balance,
    block_signature,
    blocks_balance,
    measure_update_time,
    params_balance,
    profile_units,
    split_table,
)
from lightning_pipe.split.partition import UnitCosts, all_splits, balance_by_cost, balance_step_time, unit_params
from tests.gpt2 import GPT2

CPU = torch.device("cpu")


def _bottleneck(costs: UnitCosts, counts: list[int]) -> float:
    return max(costs.stages(counts))


def test_stage_costs_add_pre_and_post_to_the_ends():
    costs = UnitCosts(pre=10.0, blocks=(1.0, 2.0, 3.0), post=5.0)
    assert costs.stages([1, 2]) == [11.0, 10.0]
    assert costs.stages([0, 3]) == [10.0, 11.0]
    assert costs.stages([3]) == [21.0]


def test_all_splits_counts():
    assert all_splits(3, 2) == [[1, 2], [2, 1]]
    assert all_splits(3, 2, first_min=0, last_min=0) == [[0, 3], [1, 2], [2, 1], [3, 0]]
    assert len(all_splits(8, 4)) == 35  # C(7, 3)
    assert len(all_splits(8, 4, first_min=0, last_min=0)) == 84  # middles >= 1: C(9, 3)


@pytest.mark.parametrize("seed", range(20))
def test_splitter_is_exact_against_exhaustive_search(seed):
    rng = random.Random(seed)
    n, k = rng.randint(4, 9), rng.randint(1, 4)
    costs = UnitCosts(rng.uniform(0, 5), tuple(rng.uniform(0.1, 3) for _ in range(n)), rng.uniform(0, 8))
    counts = balance_by_cost(costs, k)
    assert sum(counts) == n and len(counts) == k
    ends = 0 if k > 1 else 1
    best = min(_bottleneck(costs, c) for c in all_splits(n, k, first_min=ends, last_min=ends))
    assert _bottleneck(costs, counts) == pytest.approx(best)
    strict = balance_by_cost(costs, k, empty_ends=False)
    assert min(strict) >= 1
    assert _bottleneck(costs, strict) == pytest.approx(min(_bottleneck(costs, c) for c in all_splits(n, k)))


def _step(fb: UnitCosts, update: UnitCosts, counts: list[int], m: int) -> float:
    per = fb.stages(counts)
    return sum(per) + (m - 1) * max(per) + update.stages(counts)[0]


@pytest.mark.parametrize("seed", range(20))
def test_step_time_splitter_is_exact_against_exhaustive_search(seed):
    rng = random.Random(seed)
    n, k, m = rng.randint(3, 9), rng.randint(1, 4), rng.randint(1, 8)
    fb = UnitCosts(rng.uniform(0, 2), tuple(rng.uniform(0.1, 3) for _ in range(n)), rng.uniform(0, 8))
    update = UnitCosts(rng.uniform(0, 3), tuple(rng.uniform(0, 1) for _ in range(n)), rng.uniform(0, 3))
    if n < k:
        return
    counts = balance_step_time(fb, update, k, m)
    assert sum(counts) == n and len(counts) == k
    ends = 0 if k > 1 else 1
    best = min(_step(fb, update, c, m) for c in all_splits(n, k, first_min=ends, last_min=ends))
    assert _step(fb, update, counts, m) == pytest.approx(best)


def test_step_time_keeps_the_first_stage_light_when_its_update_is_exposed():
    fb = UnitCosts(0.0, (1.0,) * 4, 4.0)
    update = UnitCosts(0.0, (0.5,) * 4, 0.0)
    # The head stage (4.0) is the bottleneck whatever the split: blocks go where no optimizer step is exposed.
    assert balance_by_cost(fb, 3) == [2, 2, 0]
    assert balance_step_time(fb, update, 3, microbatches=4) == [1, 3, 0]
    with pytest.raises(PipelineConfigError, match=r"needs 6 stages.*at least one block.*`pipeline_size`"):
        balance_step_time(fb, update, 6, microbatches=4)


def test_a_heavy_head_gets_a_stage_of_its_own_only_with_empty_ends():
    costs = UnitCosts(pre=0.1, blocks=(1.0,) * 6, post=6.0)
    assert balance_by_cost(costs, 2) == [6, 0]
    assert balance_by_cost(costs, 2, empty_ends=False) == [5, 1]
    # No pre-units: the first stage must hold a block even with empty_ends.
    assert balance_by_cost(UnitCosts(0.0, (1.0,) * 4, 9.0), 3)[0] >= 1


def test_equal_blocks_split_evenly_with_earlier_stages_longer_on_ties():
    assert balance_by_cost(UnitCosts(0.0, (1.0,) * 7, 0.0), 3) == [3, 2, 2]


def test_memory_limit_excludes_splits():
    costs = UnitCosts(0.0, (1.0, 1.0, 1.0, 1.0), 0.0)
    memory = UnitCosts(0.0, (1.0, 1.0, 1.0, 5.0), 0.0)
    assert balance_by_cost(costs, 2) == [2, 2]
    assert balance_by_cost(costs, 2, memory=memory, memory_limit=5.0) == [3, 1]
    with pytest.raises(PipelineConfigError, match="fits `memory_limit=4.0` bytes per stage"):
        balance_by_cost(costs, 2, memory=memory, memory_limit=4.0)


def test_too_few_blocks_and_stages():
    with pytest.raises(PipelineConfigError, match=r"has 2 blocks.*needs 3 stages.*at least one block"):
        balance_by_cost(UnitCosts(0.0, (1.0, 1.0), 0.0), 3)
    with pytest.raises(PipelineConfigError, match="must be at least 1, got 0"):
        balance_by_cost(UnitCosts(0.0, (1.0,), 0.0), 0)
    assert balance_by_cost(UnitCosts(1.0, (1.0,), 1.0), 3) == [0, 1, 0]


def test_params_balance_weighs_embedding_and_head():
    model = GPT2(vocab=4096, n_layer=8, n_embd=32)  # embedding and head: 131k parameters each, a block 12.7k
    layout = find_layout(model)
    params = unit_params(model, layout)
    assert params.pre == 4096 * 32 + 16 * 32 and params.post == 4096 * 32 + 2 * 32
    assert blocks_balance(layout, 2) == [4, 4]
    assert params_balance(model, layout, 2) == [4, 4]
    assert params_balance(model, layout, 4) == [0, 4, 4, 0]
    with torch.device("meta"):
        meta = GPT2(vocab=4096, n_layer=8, n_embd=32)
    assert params_balance(meta, find_layout(meta), 4) == [0, 4, 4, 0]


def _profile(name: str, time_s: float, params: int = 0, act: int = 0) -> UnitProfile:
    return UnitProfile(name, params, 4 * params, act, time_s, True)


def test_cost_model_and_auto_balance():
    layout = find_layout(GPT2(n_layer=4))
    times = {"wte": 0.001, "wpe": 0.0, "ln_f": 0.0, "lm_head": 0.05}
    profiles = [_profile(u, times.get(u, 0.01), params=100, act=1000) for u in layout.units]
    model = CostModel(microbatches=4, in_flight=2, update_s_per_param=1e-5)
    assert model.time(profiles[2]) == pytest.approx(4 * 0.01 + 100 * 1e-5)
    assert model.memory(profiles[2]) == 4.0 * 400 + 2 * 1000
    assert auto_balance(profiles, layout, 2, model) == [4, 0]
    assert auto_balance(profiles, layout, 2, model, empty_ends=False) == [3, 1]
    # Per microbatch: stages 0.041 and 0.05; three more microbatches behind the slowest; stage 0 updates 600 params.
    assert model.step_time(profiles, layout, [4, 0]) == pytest.approx(0.091 + 3 * 0.05 + 600 * 1e-5)


def test_split_table():
    layout = find_layout(GPT2(n_layer=4))
    profiles = [_profile(u, 0.01, params=1000, act=2**20) for u in layout.units]
    table = split_table(layout, [3, 1], profiles, CostModel(microbatches=2, in_flight=2))
    rows = [[cell.strip() for cell in line.split(" | ")] for line in table.splitlines()]
    assert rows[0] == ["stage", "units", "parameters", "est. time/step", "est. memory"]
    assert rows[2] == ["0", "wte, wpe, h.0..h.2 (3)", "5,000", "100.0 ms", "10.08 MiB"]
    assert rows[3] == ["1", "h.3, ln_f, lm_head", "3,000", "60.0 ms", "6.05 MiB"]
    assert rows[4] == ["estimated step time (GPipe, 1F1B): 130.0 ms"]
    assert "-" in split_table(layout, [2, 2], None, None).splitlines()[2]
    model = GPT2(n_layer=4)
    plain = split_table(layout, [2, 2], None, None, network=model).splitlines()
    block = sum(p.numel() for p in model.h[0].parameters())
    embed = sum(p.numel() for p in (*model.wte.parameters(), *model.wpe.parameters()))
    assert [c.strip() for c in plain[2].split(" | ")] == ["0", "wte, wpe, h.0, h.1", f"{embed + 2 * block:,}", "-", "-"]


def test_profiler_on_a_real_network_leaves_it_untouched():
    torch.manual_seed(0)
    model = GPT2(vocab=256, n_layer=3, n_embd=32)
    before = {n: p.clone() for n, p in model.named_parameters()}
    layout = find_layout(model)
    x = torch.randint(0, 256, (2, 16))
    profiles = profile_units(model, layout, (x,), {}, CPU, repeats=1)
    assert [p.name for p in profiles] == list(layout.units)
    assert [p.measured for p in profiles] == [True, True, True, False, False, True, True]
    by = {p.name: p for p in profiles}
    assert by["h.1"].time_s == by["h.0"].time_s and by["h.0"].time_s > 0
    assert by["h.0"].params == sum(p.numel() for p in model.h[0].parameters())
    assert by["h.0"].activation_bytes > 2 * 16 * 32 * 4  # more than its input
    assert by["wte"].activation_bytes == 2 * 16 * 8  # an embedding saves its int64 indices
    assert all(p.grad is None for p in model.parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])


def test_profiler_on_a_meta_network_matches_the_real_one():
    x = torch.randint(0, 256, (2, 16))
    torch.manual_seed(0)
    real = profile_units(GPT2(vocab=256, n_layer=3, n_embd=32), find_layout(GPT2(n_layer=3)), (x,), {}, CPU)
    with torch.device("meta"):
        meta_model = GPT2(vocab=256, n_layer=3, n_embd=32)
    meta = profile_units(meta_model, find_layout(meta_model), (x,), {}, CPU)
    assert [(p.name, p.params, p.param_bytes, p.activation_bytes) for p in meta] == [
        (p.name, p.params, p.param_bytes, p.activation_bytes) for p in real
    ]
    assert all(p.time_s > 0 for p in meta)
    assert all(t.is_meta for t in meta_model.parameters())


def test_block_signature_separates_different_blocks():
    assert block_signature(nn.Linear(2, 3)) == block_signature(nn.Linear(2, 3))
    assert block_signature(nn.Linear(2, 3)) != block_signature(nn.Linear(3, 3))


def test_update_time_is_positive():
    assert 0 < measure_update_time(CPU, numel=1 << 12, repeats=1) < 1e-3


def test_resolve_balance_settings():
    from lightning_pipe.split.balance import resolve_balance

    model = GPT2(vocab=4096, n_layer=8, n_embd=32)
    layout = find_layout(model)
    cost = CostModel(microbatches=2, in_flight=2)
    kwargs = dict(example=None, device=CPU, model=cost)
    assert resolve_balance("blocks", model, layout, 4, **kwargs) == ([2, 2, 2, 2], None)
    assert resolve_balance("params", model, layout, 4, **kwargs) == ([0, 4, 4, 0], None)
    assert resolve_balance([1, 7], model, layout, 2, **kwargs) == ([1, 7], None)
    with pytest.raises(PipelineConfigError, match="is not one of 'auto', 'params', 'blocks'"):
        resolve_balance("even", model, layout, 2, **kwargs)
    with pytest.raises(PipelineConfigError, match="set `self.example_input_array`"):
        resolve_balance("auto", model, layout, 2, **kwargs)
    x = torch.randint(0, 4096, (2, 16))
    counts, profiles = resolve_balance("auto", model, layout, 2, example=((x,), {}), device=CPU, model=cost)
    assert sum(counts) == 8 and [p.name for p in profiles] == list(layout.units)
