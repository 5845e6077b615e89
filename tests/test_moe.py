"""transformers mixture-of-experts models trained with their load-balancing loss (``output_router_logits=True``): every
MoE layer's router logits reach the last stage, so the loss, the logged auxiliary loss and every router's weights
equal one device running the same microbatches. Mixtral and Qwen3-MoE (with a dense layer), 1F1B and ZBVZeroBubble at
2 processes, Interleaved1F1B at 4 (Mixtral also GPipe, InterleavedZeroBubble and DualPipeV at 2); stage by stage in one
process; and the refusals."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

pytest.importorskip("transformers")

from lightning_pipe.errors import PipelineModelError, PipelineUsageError  # noqa: E402
from tests.launch import SHARED_FOUR, SHARED_TWO, Launch  # noqa: E402
from tests.moe_models import AUX_COEF, build_moe, first_router, run_moe  # noqa: E402
from tests.reference import assert_parity, merged_state  # noqa: E402
from tests.stage_sim import run_stages, split_all, whole_network_grads  # noqa: E402

FAMILIES = ("mixtral", "qwen3_moe")
CONFIGS = {
    2: [
        {"name": f"{family}-{schedule}", "family": family, "schedule": schedule, "devices": 2}
        for family in FAMILIES
        for schedule in ("1F1B", "ZBVZeroBubble")
    ]
    # The other schedules torch offers at 2 processes, for one family: the carry is the same in every one.
    + [
        {"name": f"mixtral-{schedule}", "family": "mixtral", "schedule": schedule, "devices": 2}
        for schedule in ("GPipe", "InterleavedZeroBubble", "DualPipeV")
    ],
    4: [{"name": f"{f}-Interleaved1F1B", "family": f, "schedule": "Interleaved1F1B", "devices": 4} for f in FAMILIES],
}
TOL = 1e-5


class Holder(torch.nn.Module):
    def __init__(self, family: str) -> None:
        super().__init__()
        self.model = build_moe(family)


def _call(ids_seed: int = 0) -> dict:
    from tests.hf_models import padded_batches

    ids, mask, labels = (t[:2] for t in padded_batches(8, ids_seed, "right").tensors)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


# ------------------------------------------------------------------------------------------------ one process
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_router_logits_of_every_stage_reach_the_loss(family, schedule):
    torch.manual_seed(0)
    holder = Holder(family)
    reference = copy.deepcopy(holder.model)
    kwargs = _call()
    splits = split_all(holder, 2, schedule=schedule)
    result = run_stages(splits, (), kwargs, lambda out: out.loss)
    ref_loss, ref_grads = whole_network_grads(reference, (), kwargs, lambda out: out.loss)
    # Within float rounding, not bitwise: the carried logits' gradients reach each router in another order.
    torch.testing.assert_close(result.loss.detach(), ref_loss, rtol=1e-6, atol=0)
    out = result.outputs[-1]
    whole = reference(**kwargs)
    assert len(out.router_logits) == len(whole.router_logits) == (8 if family == "mixtral" else 7)
    torch.testing.assert_close(out.aux_loss, whole.aux_loss, rtol=1e-6, atol=0)
    grads = result.grads()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-9, msg=name)
    assert grads[first_router(grads, prefix="")].abs().sum() > 0


def test_the_auxiliary_loss_is_not_vacuous():
    """The last stage's layers alone (what it saw before the carry) give another loss, and the first stage's router
    another load-balancing gradient (only what reaches it through the hidden states)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    model = build_moe("mixtral")
    call = _call()
    out = model(**call)
    last_only = load_balancing_loss_func(out.router_logits[4:], 4, 2, call["attention_mask"])
    assert abs(float((out.aux_loss - last_only).detach())) * AUX_COEF > TOL * float(out.loss.detach())
    router = model.get_parameter(first_router(dict(model.named_parameters()), prefix=""))
    (full_grad,) = torch.autograd.grad(out.aux_loss, router, retain_graph=True)
    (last_grad,) = torch.autograd.grad(last_only, router, allow_unused=True, materialize_grads=True)
    assert (full_grad - last_grad).norm() > 0.5 * full_grad.norm()


def test_refuses_a_family_whose_router_logits_it_cannot_count():
    torch.manual_seed(0)
    holder = Holder("mixtral")
    splits = split_all(holder, 2)
    base = splits[1].bodies[1].model  # the last stage's base model: its output lists the router logits

    def drop_one(module, args, kwargs, output):
        output["router_logits"] = output["router_logits"][1:]
        return output

    handle = base.register_forward_hook(drop_one, with_kwargs=True)
    try:
        with pytest.raises(
            PipelineModelError,
            match=r"MixtralForCausalLM records router logits.*holds 4 mixture-of-experts layers.*recorded 3"
            r".*`output_router_logits=False`",
        ):
            run_stages(splits, (), _call(), lambda out: out.loss, backward=False)
    finally:
        handle.remove()


def test_refuses_router_logits_in_a_tuple_output():
    splits = split_all(Holder("mixtral"), 2)
    with pytest.raises(PipelineUsageError, match=r"`output_router_logits=True` and `return_dict=False`"):
        run_stages(splits, (), {**_call(), "return_dict": False}, lambda out: out[0], backward=False)


def test_refuses_router_logits_on_the_dataflow_frontend():
    splits = split_all(Holder("mixtral"), 2, frontend="dataflow")
    with pytest.raises(PipelineUsageError, match=r"`output_router_logits=True` on `frontend='dataflow'`"):
        run_stages(splits, (), _call(), lambda out: out.loss, backward=False)


def test_an_encoder_decoder_plan_names_the_dataflow_frontend():
    from tests.crossing_models import LitSeq2Seq

    # The plan names both stacks (transformers 4.x), or sits on the encoder's and decoder's configs (5.x).
    with pytest.raises(
        PipelineModelError,
        match=r"T5GemmaForConditionalGeneration.*(encoder and a decoder|encoder-decoder).*`frontend='dataflow'`",
    ):
        split_all(LitSeq2Seq(), 2)


# ------------------------------------------------------------------------------------------------ processes
@functools.cache
def reference(family: str) -> dict:
    return run_moe(family)


SHARED_TWO.part(__name__, "two_procs", "moe.py", CONFIGS[2])


@pytest.fixture(scope="module")
def two_procs(request) -> Launch:
    return SHARED_TWO.launch(request)  # the 2-process launch shared with other modules (tests/launch.py Shared)


SHARED_FOUR.part(__name__, "four_procs", "moe.py", CONFIGS[4])


@pytest.fixture(scope="module")
def four_procs(request) -> Launch:
    return SHARED_FOUR.launch(request)  # the 4-process launch shared with other modules (tests/launch.py Shared)


def _check(ranks: list[dict], family: str) -> None:
    ref = reference(family)
    assert_parity(ranks, ref["losses"], ref["state"], rtol=TOL, atol=1e-7)
    state = merged_state(ranks)
    router = first_router(state)
    torch.testing.assert_close(state[router], ref["state"][router], rtol=TOL, atol=1e-8)
    torch.manual_seed(0)  # the initial weights of `run_moe`'s model: the router moved, by its gradients
    assert not torch.equal(state[router], build_moe(family).state_dict()[router.removeprefix("model.")])
    for r in ranks:
        assert r["metrics"]["train_aux"] == pytest.approx(ref["metrics"]["train_aux"], rel=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS[2], ids=lambda c: c["name"])
def test_moe_two_processes(two_procs, cfg):
    _check(two_procs.ranks(cfg["name"]), cfg["family"])


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS[4], ids=lambda c: c["name"])
def test_moe_four_processes(four_procs, cfg):
    _check(four_procs.ranks(cfg["name"]), cfg["family"])
