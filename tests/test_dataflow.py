"""The dataflow frontend in one process: layouts with several block stacks, route plans, every stage run in order
against the whole network (bitwise), and every refusal of a value it cannot route."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.errors import PipelineConfigError, PipelineModelError, PipelineUsageError
from lightning_pipe.models.units import Layout, find_stacks, find_stacks_layout
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.split.builder import split_module
from lightning_pipe.split.partition import stage_units, unit_params
from lightning_pipe.split.surgery import find_block
from tests.crossing_models import DemoTransformer, LitSeq2Seq, LitUNet, UNet
from tests.stage_sim import run_stages, split_all, whole_network_grads


def _assert_same(result, reference):
    """Loss and gradients equal within float rounding: a value read by several later units, or a parameter tied
    across stages, sums its gradient's parts in another order than the whole network does, and whether that order
    changes the last bit depends on the machine's kernels."""
    ref_loss, ref_grads = reference
    torch.testing.assert_close(result.loss.detach(), ref_loss, rtol=1e-6, atol=0)
    grads = result.grads()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-9, msg=name)


def _demo_call():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 48, (4, 8), generator=g), torch.randint(0, 48, (4, 8), generator=g)
    return (x, y), {}, lambda out: F.nll_loss(out, y.view(-1))


# ------------------------------------------------------------------------------------------------ layouts
def test_demo_transformer_layout_has_both_stacks_and_the_encoder_norm_between():
    network = DemoTransformer().model
    stacks = find_stacks(network)
    assert stacks == ["transformer.encoder.layers", "transformer.decoder.layers"]
    layout = find_stacks_layout(network, stacks)
    assert layout.pre == ("embedding",)
    assert layout.post == ("transformer.decoder.norm", "decoder")
    assert layout.between == (("transformer.encoder.layers.1", ("transformer.encoder.norm",)),)
    assert stage_units(layout, [1, 1, 1, 1]) == [
        ("embedding", "transformer.encoder.layers.0"),
        ("transformer.encoder.layers.1", "transformer.encoder.norm"),
        ("transformer.decoder.layers.0",),
        ("transformer.decoder.layers.1", "transformer.decoder.norm", "decoder"),
    ]


def test_unet_layout_places_the_middle_block_with_the_last_down_block():
    layout = find_stacks_layout(UNet(), find_stacks(UNet()))
    assert layout.blocks == ("down.0", "down.1", "up.0", "up.1")
    assert (layout.pre, layout.post, layout.between) == (("inc",), ("outc",), (("down.1", ("mid",)),))
    assert layout.units == ("inc", "down.0", "down.1", "mid", "up.0", "up.1", "outc")


def test_between_units_count_with_their_block_in_the_parameter_balance():
    network = UNet()
    layout = find_stacks_layout(network, find_stacks(network))
    costs = unit_params(network, layout)
    mid = sum(p.numel() for p in network.mid.parameters())
    assert costs.blocks[1] == sum(p.numel() for p in network.down[1].parameters()) + mid


def test_a_module_reachable_under_two_names_is_one_unit_placed_once():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2)
    t5 = transformers.T5ForConditionalGeneration(config)
    layout = find_stacks_layout(t5, find_stacks(t5))
    # transformers 4.x: the encoder's and decoder's `embed_tokens` are the `shared` module itself (one unit, placed
    # with it); 5.x: the decoder's is a module of its own whose weight is tied to it (a tie between stages).
    assert layout.pre[:2] == ("shared", "encoder.embed_tokens")
    assert unit_params(t5, layout).pre == t5.shared.weight.numel()


def test_blocks_may_name_the_stacks():
    network = UNet()
    assert find_stacks(network, ["up", "down"]) == ["down", "up"]
    with pytest.raises(
        PipelineModelError, match=r"`blocks=\['down', 'down'\]` names a container twice.*each block stack once"
    ):
        find_stacks(network, ["down", "down"])
    assert Layout(("a",), ("b", "c"), (), (("b", ("n",)),)).units == ("a", "b", "n", "c")


def test_several_stacks_need_the_dataflow_frontend():
    with pytest.raises(PipelineConfigError, match=r"names several block stacks, which only `frontend='dataflow'`"):
        PipelineSettings(frontend="modules", blocks=["down", "up"])
    assert PipelineSettings(blocks=["down", "up"]).frontend == "auto"  # "auto" chooses dataflow at the cut
    with pytest.raises(
        PipelineConfigError,
        match=r"`blocks` must be 'auto'.*container of blocks.*list of such names, got \['down', 3\]",
    ):
        PipelineSettings(frontend="dataflow", blocks=["down", 3])
    assert PipelineSettings(frontend="dataflow", blocks=["down", "up"]).blocks == ("down", "up")


def test_tensor_parallelism_is_refused_with_the_dataflow_frontend():
    with pytest.raises(PipelineConfigError, match=r"`tensor_parallel=2` is not supported with `frontend='dataflow'`"):
        PipelineSettings(frontend="dataflow", tensor_parallel=2)
    PipelineSettings(frontend="dataflow", tensor_parallel=1)


# ------------------------------------------------------------------------------------------------ exact stages
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_demo_transformer_stages_equal_the_whole_network(schedule):
    torch.manual_seed(0)
    lm = DemoTransformer()
    reference = copy.deepcopy(lm.model)
    args, kwargs, loss_of = _demo_call()
    splits = split_all(lm, 2, frontend="dataflow", schedule=schedule)
    _assert_same(run_stages(splits, args, kwargs, loss_of), whole_network_grads(reference, args, kwargs, loss_of))


def test_demo_transformer_routes_memory_and_target_only_as_far_as_read():
    splits = split_all(DemoTransformer(), 2, frontend="dataflow", schedule="ZBVZeroBubble")
    args, kwargs, _ = _demo_call()
    plan = splits[0].stage_call.plan(args, kwargs)
    memory, target = ("transformer.encoder.norm", 0, 0), ("embedding", 1, 0)
    assert plan.sends == (
        (target, ("transformer.encoder.layers.0", 0, 0)),
        (target, memory),
        (memory, ("transformer.decoder.layers.0", 0, 0)),
    )
    assert plan.off_input == (False, False, False, False)


def test_unet_skips_travel_to_their_up_block():
    torch.manual_seed(0)
    lm = LitUNet()
    reference = copy.deepcopy(lm.model)
    x, target = torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8)
    loss_of = lambda out: F.mse_loss(out, target)  # noqa: E731
    splits = split_all(lm, 2, frontend="dataflow", schedule="ZBVZeroBubble")
    _assert_same(run_stages(splits, (x,), {}, loss_of), whole_network_grads(reference, (x,), {}, loss_of))
    sends = splits[0].stage_call.plan((x,), {}).sends
    assert sends[0] == (("inc", 0, 0), ("down.0", 0, 0))
    assert sends[2] == (("inc", 0, 0), ("up.0", 0, 0))


def test_t5gemma_stages_equal_the_whole_model_and_a_middle_embedding_runs_whole_backwards():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    lm = LitSeq2Seq()
    reference = copy.deepcopy(lm.model)
    src, tgt = torch.randint(0, 47, (2, 8)), torch.randint(0, 47, (2, 8))
    kwargs = dict(input_ids=src, attention_mask=torch.ones_like(src), labels=tgt, use_cache=False)
    loss_of = lambda out: out.loss  # noqa: E731
    splits = split_all(lm, 2, frontend="dataflow", schedule="ZBVZeroBubble")
    _assert_same(run_stages(splits, (), kwargs, loss_of), whole_network_grads(reference, (), kwargs, loss_of))
    # The decoder's embedding (stage 1) reads only the labels: torch's split backward would lose its gradient.
    plan = splits[0].stage_call.plan((), kwargs)
    assert plan.off_input == (False, True, False, False)
    assert splits[0].stage_call.full_backward(1) and not splits[0].stage_call.full_backward(2)


class MoEBlock(nn.Module):
    """A hand-written top-2 mixture of experts that returns its load-balancing statistics with its output."""

    def __init__(self, dim: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = x.reshape(-1, x.shape[-1])
        probs = self.gate(h).softmax(-1)
        weights, chosen = probs.topk(2, dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)  # data-dependent: the planner runs this block on zero weights
            out = out.index_add(0, rows, expert(h[rows]) * weights[rows, slot, None])
        counts = F.one_hot(chosen, len(self.experts)).sum((0, 1)).float()
        return x + out.reshape(x.shape), counts, probs.sum(0)


class MoELM(nn.Module):
    def __init__(self, layers: int = 4, dim: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(MoEBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(idx)
        counts = probs = 0
        for block in self.blocks:
            h, c, p = block(h)
            counts, probs = counts + c, probs + p
        tokens = idx.numel() * len(self.blocks)
        aux = len(counts) * (counts / (2 * tokens) * probs / tokens).sum()  # Switch-style, from summed statistics
        return self.head(h), aux


class LitMoELM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = MoELM()


def test_hand_written_moe_statistics_reach_the_last_stage_exactly():
    torch.manual_seed(0)
    lm = LitMoELM()
    reference = copy.deepcopy(lm.model)
    idx = torch.randint(0, 16, (2, 5))
    loss_of = lambda out: F.cross_entropy(out[0].flatten(0, 1), idx.flatten()) + 0.1 * out[1]  # noqa: E731
    splits = split_all(lm, 2, frontend="dataflow", schedule="ZBVZeroBubble")
    _assert_same(run_stages(splits, (idx,), {}, loss_of), whole_network_grads(reference, (idx,), {}, loss_of))
    plan = splits[0].stage_call.plan((idx,), {})
    assert set(plan.probed) == {"blocks.0", "blocks.1", "blocks.2", "blocks.3"}
    # Each block's statistics travel from its stage to the last one, where the forward sums them.
    assert ("blocks.0", 0, 1) in plan.sends[2] and ("blocks.0", 0, 2) in plan.sends[2]


def test_stand_ins_are_skipped_by_per_block_wrappers():
    splits = split_all(LitUNet(), 2, frontend="dataflow")
    body = splits[0].bodies[0]
    assert find_block(body, "down.0") is body.down[0]
    assert find_block(body, "up.0") is None
    with pytest.raises(
        PipelineUsageError, match=r"Unit `up\.0` is held by another.*pipeline stage.*inside the strategy's steps"
    ):
        body.up[0](torch.zeros(1))
    assert not hasattr(body.up[0], "conv")  # outside a stage's run a stand-in is an empty module


# ------------------------------------------------------------------------------------------------ refusals
class Stack(nn.Module):
    def __init__(self, n: int = 4, dim: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))
        self.head = nn.Linear(dim, dim)


class Holder(nn.Module):
    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.model = network


def _refused(network: nn.Module, match: str, *calls: torch.Tensor, error: type = PipelineModelError) -> None:
    splits = split_all(Holder(network), 2, frontend="dataflow")
    with pytest.raises(error, match=match):
        for x in calls or (torch.ones(2, 4),):
            run_stages(splits, (x,), {}, lambda out: out.sum(), backward=False)


def test_refuses_a_unit_that_reads_a_later_stage():
    class Misordered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 4)  # defined first, runs last: placed on the first stage
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    _refused(Misordered(), r"unit `head` \(pipeline stage 0\) reads output 0 of unit `blocks.3`, which stage 1 holds")


def test_refuses_glue_that_reads_values_of_a_unit_output():
    class Branching(Stack):
        def forward(self, x):
            for block in self.blocks:
                x = block(x)
                if x.sum() > 0:  # reads the value: not on a stage without the block
                    x = -x
            return self.head(x)

    _refused(
        Branching(),
        r"reads the values of a tensor computed from unit\(s\) `blocks.0` \(stage 0\) outside any unit \(__bool__\)"
        r" at .*test_dataflow.py:\d+ \(`if x.sum\(\) > 0:",
    )


def test_refuses_another_stages_parameter_used_outside_its_unit():
    class TiedByHand(Stack):
        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x @ self.blocks[0].weight.T  # the first block's weight, on the last stage

    _refused(TiedByHand(), r"the network's output \(pipeline stage 1\) is computed from parameter `blocks.0.weight`")


def test_refuses_a_tensor_an_absent_unit_keeps_as_an_attribute():
    class Stashing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            self.norm = x.norm()  # kept for later: never travels
            return self.lin(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Stashing() for _ in range(4))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x * self.blocks[0].norm

    _refused(Net(), r"reads `blocks.0.norm` on pipeline stage 1, a tensor that unit `blocks.0` keeps as an attribute")


def test_refuses_values_units_put_into_a_shared_list():
    class Collecting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, seen):
            seen.append(x)
            return self.lin(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Collecting() for _ in range(4))

        def forward(self, x):
            seen: list = []
            for block in self.blocks:
                x = block(x, seen)
            return torch.stack(seen).sum(0) + x

    _refused(Net(), r"Unit `blocks.0` \(pipeline stage 0\) changes the list or dict it receives as argument \[0\]\[1\]")


def test_refuses_a_forward_that_takes_another_path():
    class ByValue(Stack):
        def forward(self, x):
            h = x
            for block in self.blocks:
                h = block(h)
            repeats = int(x[0, 0].item())  # a branch on the batch's values: another count of head calls
            for _ in range(repeats):
                h = self.head(h)
            return h

    _refused(
        ByValue(),
        r"took another path on pipeline stage 1 than when its routes were planned: call 2 of unit"
        r" `head`",
        torch.ones(2, 4),
        torch.full((2, 4), 2.0),
    )


def test_refuses_a_unit_output_changed_in_place_after_it_was_sent():
    class InPlace(Stack):
        def forward(self, x):
            first = self.blocks[0](x)
            first.mul_(2)  # the stage holding blocks.0 and blocks.1 would send the changed value
            h = self.blocks[1](first)
            for block in self.blocks[2:]:
                h = block(h)
            return self.head(h) + first

    _refused(InPlace(), r"changed output 0 of unit `blocks.0` in place after the unit returned")


def test_refuses_a_unit_that_runs_neither_on_fakes_nor_on_zeros():
    class Picky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if bool((x == 0).all()):
                raise ValueError("no zeros please")
            return self.lin(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Picky() for _ in range(4))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    _refused(Net(), r"Picky reads its inputs' values .* also failed on zero weights and inputs \(ValueError")


def test_refuses_a_network_that_cannot_be_copied():
    class Locked(Stack):
        def forward(self, x):
            return self.head(x)

    network = Locked()
    network.lock = threading.Lock()
    settings = PipelineSettings(frontend="dataflow").resolve(2)
    with pytest.raises(
        PipelineModelError,
        match=r"`frontend='dataflow'` copies Locked.*fake parameters.*copy failed.*cannot pickle"
        r".*deep-copied.*`frontend='modules'`",
    ):
        split_module(Holder(network), settings, pipeline_rank=0, device=torch.device("cpu"))


def _seq2seq(model: nn.Module, schedule: str, first_token: int) -> tuple[list, dict]:
    """Split a transformers encoder-decoder into 2 ranks' stages under ``schedule``, check one training step against
    the whole model (loss and every gradient bitwise), and return the splits and the call."""
    holder = Holder(model)
    reference = copy.deepcopy(holder.model)
    src, tgt = torch.randint(first_token, 32, (2, 6)), torch.randint(first_token, 32, (2, 5))
    kwargs = dict(input_ids=src, attention_mask=torch.ones_like(src), labels=tgt, use_cache=False)
    splits = split_all(holder, 2, frontend="dataflow", schedule=schedule)
    _assert_same(run_stages(splits, (), kwargs, _loss_of), whole_network_grads(reference, (), kwargs, _loss_of))
    return splits, kwargs


def _loss_of(out):
    return out.loss


def test_t5_with_its_shared_embedding_equals_the_whole_model():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=32,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    splits, kwargs = _seq2seq(transformers.T5ForConditionalGeneration(config), "ZBVZeroBubble", first_token=1)
    sends = splits[0].stage_call.plan((), kwargs).sends
    # The first encoder block's relative position bias feeds the second encoder block on the next stage.
    assert ("encoder.block.0", 0, 1) in sends[0]


def test_bart_pipelines_as_encoder_and_decoder_and_a_split_inside_a_stack_is_refused():
    """BART has no pipeline plan and defines `layernorm_embedding` (run before the first layer) after its layers: on
    2 stages (encoder | decoder) it is exact; 4 stages would put a layer before that unit's stage, which is refused."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=32,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        max_position_embeddings=32,
        pad_token_id=1,
        decoder_start_token_id=2,
    )
    model = transformers.BartForConditionalGeneration(config)
    _, kwargs = _seq2seq(model, "1F1B", first_token=3)
    splits = split_all(Holder(model), 2, frontend="dataflow", schedule="ZBVZeroBubble")
    with pytest.raises(
        PipelineModelError,
        match=r"unit `model.encoder.layers.0` \(pipeline stage 0\) reads output 0 of unit"
        r" `model.encoder.layernorm_embedding`, which stage 1 holds",
    ):
        run_stages(splits, (), kwargs, _loss_of)


def test_an_error_inside_a_stage_is_described_for_the_dataflow_frontend():
    from lightning_pipe.step.stage import StageModule

    split = split_all(LitUNet(), 2, frontend="dataflow")[0]
    stage = StageModule(split.bodies[0], 0, 2, split.stage_call)
    note = stage.describe_failure(None, None, 0)
    assert "raised on rank 0 in pipeline stage 0 of 2 (microbatch 0)" in note
    assert "every stage runs the network's whole forward" in note and "(up.0, up.1, outc)" in note
