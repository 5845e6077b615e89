"""Activation checkpointing of blocks: same numbers, same names, fewer saved bytes."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.measure.memory import saved_bytes
from lightning_pipe.models.units import find_layout
from lightning_pipe.parallel.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpointed_blocks,
    remove_activation_checkpointing,
)
from lightning_pipe.settings import resolve_every
from lightning_pipe.split.partition import stage_units
from lightning_pipe.split.surgery import prune
from tests.gpt2 import GPT2


def _stage(index: int, counts: list[int]) -> tuple[GPT2, tuple[str, ...]]:
    torch.manual_seed(0)
    model = GPT2(vocab=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
    layout = find_layout(model)
    prune(model, stage_units(layout, counts)[index], layout.units)
    return model, layout.blocks


def _loss_and_grads(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    out = model(x)
    loss = (out.float() ** 2).mean()
    loss.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_which_blocks():
    names = [f"h.{i}" for i in range(6)]
    assert checkpointed_blocks(names, 1) == names
    assert checkpointed_blocks(names, 2) == ["h.1", "h.3", "h.5"]
    assert checkpointed_blocks(names, 0) == []
    assert resolve_every(True) == 1 and resolve_every(False) == 0 and resolve_every(3) == 3


@pytest.mark.parametrize("value", [-1, 1.5, "yes"])
def test_bad_value_is_refused(value):
    with pytest.raises(
        PipelineConfigError, match=rf"`activation_checkpointing={value!r}`.*bool or an int >= 0.*Use True"
    ):
        resolve_every(value)


@pytest.mark.parametrize(("index", "x_shape"), [(0, "tokens"), (1, "hidden")])
def test_same_outputs_and_gradients_bitwise_and_same_names(index, x_shape):
    plain, blocks = _stage(index, [2, 2])
    wrapped = copy.deepcopy(plain)
    names = [n for n, _ in plain.named_parameters()]
    assert apply_activation_checkpointing(wrapped, blocks, 1) == (["h.0", "h.1"] if index == 0 else ["h.2", "h.3"])
    assert [n for n, _ in wrapped.named_parameters()] == names
    assert wrapped.state_dict().keys() == plain.state_dict().keys()
    torch.manual_seed(1)
    x = torch.randint(0, 64, (3, 16)) if x_shape == "tokens" else torch.randn(3, 16, 32, requires_grad=True)
    out_a, grads_a = _loss_and_grads(plain, x)
    out_b, grads_b = _loss_and_grads(wrapped, x)
    assert torch.equal(out_a, out_b)
    for name in names:
        assert torch.equal(grads_a[name], grads_b[name]), name


def test_fewer_saved_bytes_and_undo():
    model, blocks = _stage(1, [2, 2])
    x = torch.randn(4, 16, 32, requires_grad=True)
    before = saved_bytes(model, (x,))
    apply_activation_checkpointing(model, blocks, 1)
    apply_activation_checkpointing(model, blocks, 1)  # idempotent
    after = saved_bytes(model, (x,))
    assert after * 3 <= before
    remove_activation_checkpointing(model)
    assert saved_bytes(model, (x,)) == before


def test_wrapped_model_copies_and_pickles():
    model, blocks = _stage(0, [4])
    apply_activation_checkpointing(model, blocks, 2)
    clone = pickle.loads(pickle.dumps(model))
    x = torch.randint(0, 64, (2, 16))
    assert torch.equal(clone(x), model(x))
    assert copy.deepcopy(model).h[1].forward.args[0] is not model.h[1]


def test_split_backward_of_zero_bubble_schedules_gives_the_same_gradients():
    # The zero-bubble schedules run input gradients and weight gradients as two passes (torch's private helpers).
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    plain, blocks = _stage(1, [2, 2])
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, blocks, 1)
    results = []
    for model in (plain, wrapped):
        x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = model(x)
        dinputs, groups = stage_backward_input([out], [torch.ones_like(out)], [x], model.parameters())
        stage_backward_weight(model.parameters(), groups)
        results.append((dinputs[0], [p.grad for p in model.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def test_dropout_draws_the_same_masks_when_recomputed():
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5)) for _ in range(3)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    plain = Net()
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, ["blocks.0", "blocks.1", "blocks.2"], 1)
    x = torch.randn(4, 16)
    results = []
    for model in (plain, wrapped):
        torch.manual_seed(5)
        results.append(_loss_and_grads(model, x))
    assert torch.equal(results[0][0], results[1][0])
    for name, grad in results[0][1].items():
        assert torch.equal(grad, results[1][1][name]), name
