"""Pure splitting and configuration logic: no process group needed."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from lightning_pipe.errors import MicrobatchError, PipelineConfigError, PipelineModelError
from lightning_pipe.microbatch import batch_size, resolve_microbatches, signature, split_batch, training_microbatches
from lightning_pipe.models.units import Layout, find_block_stack, find_layout
from lightning_pipe.settings import PipelineSettings, canonical_schedule, resolve_pipeline_size, resolve_schedule
from lightning_pipe.split.partition import (
    balance_blocks,
    check_balance,
    counts_from_split_points,
    keep_together,
    stage_to_rank,
    stage_units,
)
from tests.models import Block, TinyLM


class LitGPTShaped(nn.Module):
    """litgpt's layout: lm_head defined before a `transformer` dict of wte, h (the blocks), ln_f."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(4, 8)
        self.transformer = nn.ModuleDict(
            dict(wte=nn.Embedding(8, 4), h=nn.ModuleList(Block(4) for _ in range(3)), ln_f=nn.LayerNorm(4))
        )


def test_layout_of_seed_style_model():
    layout = find_layout(TinyLM(n_layers=3))
    assert layout == Layout(pre=("embed",), blocks=("layers.0", "layers.1", "layers.2"), post=("norm", "head"))


def test_layout_prefers_uniform_block_container_over_larger_mixed_one():
    assert find_block_stack(LitGPTShaped()) == "transformer.h"
    layout = find_layout(LitGPTShaped())
    assert layout.blocks == ("transformer.h.0", "transformer.h.1", "transformer.h.2")
    assert layout.pre == ("lm_head", "transformer.wte") and layout.post == ("transformer.ln_f",)


def test_layout_of_sequential_keeps_stateless_children_as_blocks():
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert find_layout(net) == Layout(pre=(), blocks=("0", "1", "2"), post=())


def test_stateless_siblings_are_not_units():
    model = TinyLM(n_layers=2)
    model.drop = nn.Dropout(0.1)
    assert "drop" not in find_layout(model).units


def test_explicit_blocks_name():
    assert find_layout(TinyLM(n_layers=2), blocks="layers").blocks == ("layers.0", "layers.1")
    with pytest.raises(PipelineModelError, match=r"`blocks='nope'` names no submodule"):
        find_layout(TinyLM(), blocks="nope")
    with pytest.raises(PipelineModelError, match=r"`blocks='head'` is a Linear, not an nn.ModuleList"):
        find_layout(TinyLM(), blocks="head")


def test_model_without_block_stack_is_refused():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)

    with pytest.raises(PipelineModelError, match=r"Plain .*splittable block stack.*`frontend='trace'`"):
        find_layout(Plain())


def test_balance_blocks():
    assert balance_blocks(8, 4) == [2, 2, 2, 2]
    assert balance_blocks(7, 3) == [3, 2, 2]
    with pytest.raises(PipelineConfigError, match=r"has 3 blocks.*needs 4 stages.*`pipeline_size`/`stages_per_rank`"):
        balance_blocks(3, 4)


def test_split_points():
    blocks = tuple(f"layers.{i}" for i in range(6))
    assert counts_from_split_points(blocks, ["layers.2", "layers.5"], 3) == [2, 3, 1]
    with pytest.raises(PipelineConfigError, match="has 1 entries but 3 stages need 2"):
        counts_from_split_points(blocks, ["layers.2"], 3)
    with pytest.raises(
        PipelineConfigError, match=r"`split_points` entry 'layers\.9' is not a block.*Blocks are: layers\.0"
    ):
        counts_from_split_points(blocks, ["layers.9"], 2)
    with pytest.raises(
        PipelineConfigError, match=r"`split_points=\['layers\.4', 'layers\.2'\]`.*distinct blocks.*model order"
    ):
        counts_from_split_points(blocks, ["layers.4", "layers.2"], 3)
    with pytest.raises(PipelineConfigError, match=r"`split_points=\['layers\.0'\]`.*distinct blocks.*model order"):
        counts_from_split_points(blocks, ["layers.0"], 2)


def test_check_balance():
    assert check_balance([1, 3], 4, 2) == [1, 3]
    with pytest.raises(PipelineConfigError, match=r"`balance=\[4\]` has 1 entries.*2 stages"):
        check_balance([4], 4, 2)
    with pytest.raises(PipelineConfigError, match=r"`balance=\[0, 4\]`.*no blocks.*at least 1"):
        check_balance([0, 4], 4, 2)
    with pytest.raises(PipelineConfigError, match=r"sums to 3 but the model has 4 blocks"):
        check_balance([1, 2], 4, 2)


def test_stage_units_put_pre_first_and_post_last():
    layout = Layout(pre=("embed",), blocks=("b0", "b1", "b2"), post=("head",))
    assert stage_units(layout, [1, 2]) == [("embed", "b0"), ("b1", "b2", "head")]
    assert stage_units(layout, [3]) == [("embed", "b0", "b1", "b2", "head")]


@pytest.mark.parametrize(
    "pp, stages, style", [(2, 4, "loop"), (4, 8, "loop"), (2, 4, "v"), (4, 8, "v"), (3, 3, "loop")]
)
def test_stage_to_rank_matches_torch(pp, stages, style):
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    expected = generate_stage_to_rank_mapping(pp, stages, style=style)
    assert stage_to_rank(stages, pp, style) == [expected[s] for s in range(stages)]


def test_v_placement_puts_last_stage_on_rank_zero():
    assert stage_to_rank(4, 2, "v") == [0, 1, 1, 0]


def test_schedule_resolution():
    assert resolve_schedule("auto", "auto") == ("1F1B", 1)
    assert resolve_schedule("auto", 2) == ("Interleaved1F1B", 2)
    assert resolve_schedule("gpipe", "auto") == ("GPipe", 1)
    assert resolve_schedule("zbvzerobubble", "auto") == ("ZBVZeroBubble", 2)
    assert resolve_schedule("LoopedBFS", 3) == ("LoopedBFS", 3)
    assert canonical_schedule("DUALPIPEV") == "DualPipeV"


def test_schedule_errors():
    with pytest.raises(PipelineConfigError, match=r"Unknown `schedule='Foo'`. Choose one of GPipe, 1F1B"):
        resolve_schedule("Foo", "auto")
    with pytest.raises(
        PipelineConfigError, match=r"`schedule='GPipe'`.*one stage per rank.*`stages_per_rank=2`.*`stages_per_rank=1`"
    ):
        resolve_schedule("GPipe", 2)
    with pytest.raises(
        PipelineConfigError,
        match=r"`schedule='DualPipeV'`.*two stages per rank.*`stages_per_rank=3`.*`stages_per_rank=2`",
    ):
        resolve_schedule("DualPipeV", 3)
    with pytest.raises(PipelineConfigError, match=r"`stages_per_rank` must be 'auto' or an int >= 1, got 0"):
        resolve_schedule("1F1B", 0)


def test_pipeline_size_resolution():
    assert resolve_pipeline_size("auto", 4) == (4, 1)
    assert resolve_pipeline_size(2, 4) == (2, 2)
    with pytest.raises(PipelineConfigError, match=r"world size \(6 processes\) is not divisible by `pipeline_size=4`"):
        resolve_pipeline_size(4, 6)
    with pytest.raises(PipelineConfigError, match=r"`pipeline_size` must be 'auto' or an int >= 1, got 0"):
        resolve_pipeline_size(0, 4)


def test_microbatch_resolution():
    assert resolve_microbatches("auto", None, 8, 4, "microbatches") == 4
    assert resolve_microbatches("auto", None, 2, 4, "microbatches") == 2  # short last batch under "auto"
    assert resolve_microbatches(2, None, 8, 4, "microbatches") == 2
    assert resolve_microbatches("auto", 2, 8, 4, "microbatches") == 4
    with pytest.raises(
        MicrobatchError, match=r"batch of 10 samples.*`microbatches=4`.*multiple of 4.*`drop_last=True`"
    ):
        resolve_microbatches(4, None, 10, 2, "microbatches")
    with pytest.raises(MicrobatchError, match=r"batch of 8 samples.*`microbatch_size=3`.*multiple of it"):
        resolve_microbatches("auto", 3, 8, 2, "microbatches")


def test_split_batch_structures():
    x, y = torch.arange(8).reshape(4, 2), torch.arange(4)
    parts = split_batch({"x": x, "y": y, "name": "s", "scale": torch.tensor(2.0)}, 2)
    assert torch.equal(parts[1]["x"], x[2:]) and torch.equal(parts[0]["y"], y[:2])
    assert parts[0]["name"] == "s" and parts[1]["scale"] == 2.0
    tuples = split_batch((x, [y, y]), 4)
    assert torch.equal(tuples[3][1][0], y[3:])
    assert batch_size([x]) == 4
    assert signature((x, y)) == (((4, 2), torch.int64), ((4,), torch.int64))
    with pytest.raises(MicrobatchError, match=r"type dict into microbatches.*no tensor.*batch dimension.*dim 0"):
        batch_size({"a": "text"})


def _count(size, microbatches=2, microbatch_size=None, schedule="1F1B", pipeline_size=2, stages_per_rank=1):
    from lightning_pipe.step.executors.schedule import schedule_accepts

    accepts = functools.partial(schedule_accepts, schedule, pipeline_size, stages_per_rank)
    stages = pipeline_size * stages_per_rank
    return training_microbatches(size, microbatches, microbatch_size, stages, accepts, schedule)


def test_a_batch_the_count_divides_runs_as_configured():
    assert _count(8) == 2 and _count(8, microbatches=4) == 4 and _count(8, "auto") == 2
    assert _count(8, microbatch_size=2) == 4
    # the configured count is kept even where the schedule refuses it: torch's error then names it (and GPipe)
    assert _count(8, microbatches=1) == 1


def test_a_batch_the_count_does_not_divide_runs_as_the_fewest_accepted_equal_microbatches_no_larger():
    assert _count(9) == 3  # 3 of 3: no larger than 2 microbatches of a 9-sample batch would be
    assert _count(7) == 7 and _count(5, microbatches=4) == 5
    assert _count(4, microbatches=8) == 4  # fewer samples than microbatches: one sample each
    assert _count(10, microbatch_size=4) == 5  # microbatches of 2, no larger than 4
    assert _count(9, schedule="GPipe") == 3
    # Interleaved1F1B needs whole rounds: 9 microbatches on 2 ranks are refused, 3 are not
    assert _count(9, microbatches=4, schedule="Interleaved1F1B", stages_per_rank=2) == 3
    assert _count(8, microbatches=3, schedule="DualPipeV", stages_per_rank=2) == 4  # DualPipeV: at least 4 here


def test_a_batch_the_schedule_runs_as_no_count_goes_to_its_fallback_on_the_same_stages():
    from lightning_pipe.step.executors.schedule import microbatch_plan

    def plan(size, **kwargs):
        settings = PipelineSettings(**kwargs).resolve(2)
        return microbatch_plan(settings, size)

    assert plan(1, schedule="1F1B", microbatches=2) == (1, "GPipe")
    assert plan(3, schedule="DualPipeV", microbatches=4) == (3, "ZBVZeroBubble")  # DualPipeV: at least 4 here
    assert plan(9, schedule="1F1B", microbatches=2) == (3, "1F1B")  # a count 1F1B takes: no fallback
    assert plan(8, schedule="1F1B", microbatches=1) == (1, "1F1B")  # the configured count is kept: torch names it
    # microbatches="auto" (one per stage) on a batch smaller than the stages: one sample each, under the fallback
    assert plan(3, schedule="DualPipeV") == (3, "ZBVZeroBubble") and plan(1, schedule="1F1B") == (1, "GPipe")
    assert plan(4, schedule="DualPipeV") == (4, "DualPipeV")


def test_a_batch_no_count_can_run_is_refused_naming_the_schedule_and_the_fix():
    with pytest.raises(MicrobatchError, match=r"batch of 1 samples.*1F1B schedule with 2 stages.*\(1\).*'GPipe'"):
        _count(1)
    with pytest.raises(MicrobatchError, match=r"batch of 3 samples.*DualPipeV schedule with 4 stages.*\(1, 3\)"):
        _count(3, schedule="DualPipeV", stages_per_rank=2)


@pytest.mark.parametrize(
    ("counts", "together", "expected"),
    [
        ([2, 2], [(1, 3)], [1, 3]),  # the cut inside 1..3 moves to its start
        ([3, 1], [(0, 2)], [3, 1]),  # no cut inside: unchanged
        ([1, 3], [(0, 1)], [2, 2]),  # the nearer end is the range's end
        ([8, 7, 8, 7], [(18, 29)], [8, 7, 3, 12]),  # Gemma 3n E2B: 30 layers, 10 sharing layers 18 and 19's
        ([9, 9, 9, 8], [(18, 34)], [6, 6, 6, 17]),  # Gemma 3n's default: 35 layers, 15 sharing; the first 18 re-spread
        ([1, 1, 2], [(0, 1)], [2, 1, 1]),  # moved to the range's end: the stages after it re-spread
        ([1, 1, 1, 1], [(1, 3)], [1, 1, 1, 1]),  # no stage could hold them: unchanged (the stage call refuses)
        ([2, 2, 2], [(1, 2), (3, 4)], [1, 2, 3]),  # two ranges, each cut moved to its range's start
    ],
)
def test_keep_together_moves_cuts_out_of_ranges_one_stage_must_hold(counts, together, expected):
    assert keep_together(counts, together) == expected
    assert sum(keep_together(counts, together)) == sum(counts)
