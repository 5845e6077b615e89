"""Unmodified transformers causal LMs under the pipeline equal one device: Llama with tied and untied embeddings,
right and left padding, ``labels=-100`` on padding and a token-weighted loss, under 1F1B and ZBVZeroBubble at 2
processes and Interleaved1F1B at 4; Qwen2 as the second family at 2 processes; Llama built in ``configure_model``
with one device's initial values and shuffled data order. Training and validation. At 4
processes also 2 stages x 2 replicas, sharded (FSDP) against replicated (DDP)."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf_models import run_hf  # noqa: E402
from tests.launch import SHARED_FOUR, SHARED_TWO, Launch  # noqa: E402
from tests.reference import assert_parity  # noqa: E402


def _cfg(schedule: str, devices: int, family: str, tie: bool, side: str) -> dict:
    name = f"{family}-{'tied' if tie else 'untied'}-{side}-{schedule}-{devices}"
    return {"name": name, "schedule": schedule, "devices": devices, "family": family, "tie": tie, "side": side}


CONFIGS = {
    2: [
        _cfg("1F1B", 2, "llama", True, "right"),
        _cfg("1F1B", 2, "llama", False, "left"),
        _cfg("ZBVZeroBubble", 2, "llama", True, "left"),
        _cfg("ZBVZeroBubble", 2, "llama", False, "right"),
        _cfg("1F1B", 2, "qwen2", True, "left"),
        # built in configure_model (meta device): one device's initial values and data order (init_values)
        {**_cfg("1F1B", 2, "llama", False, "right"), "name": "llama-configure-model-1F1B", "built": "configure_model"},
        {
            **_cfg("ZBVZeroBubble", 2, "llama", True, "left"),
            "name": "llama-configure-model-ZBV",
            "built": "configure_model",
        },
    ],
    4: [_cfg("Interleaved1F1B", 4, "llama", True, "right"), _cfg("Interleaved1F1B", 4, "llama", False, "left")],
}
#: 2 stages x 2 replicas, in the 4-process launch: the replicas' FSDP shards against DDP's whole copies (the
#: microbatches' token means weighted by samples); then token-weighted under FSDP, which the replicas' different token
#: counts (right padding) make FSDP refuse (last: the refusal ends the launch)
_PP2 = {**_cfg("1F1B", 4, "llama", True, "right"), "pipeline_size": 2}
REPLICATED = [
    {**_PP2, "name": f"llama-pp2-{mode}", "data_parallel": mode, "weighted": False} for mode in ("ddp", "fsdp")
]
FSDP_WEIGHTED = {**_PP2, "name": "llama-pp2-fsdp-weighted", "data_parallel": "fsdp"}
TOL = 1e-5


@functools.cache
def reference(family: str, tie: bool, side: str, built: str = "init") -> dict:
    return run_hf(family=family, tie=tie, side=side, built=built)


SHARED_TWO.part(__name__, "two_procs", "hf.py", CONFIGS[2])


@pytest.fixture(scope="module")
def two_procs(request) -> Launch:
    return SHARED_TWO.launch(request)  # the 2-process launch shared with other modules (tests/launch.py Shared)


SHARED_FOUR.part(__name__, "four_procs", "hf.py", [*CONFIGS[4], *REPLICATED, FSDP_WEIGHTED])


@pytest.fixture(scope="module")
def four_procs(request) -> Launch:
    return SHARED_FOUR.launch(request)  # the 4-process launch shared with other modules (tests/launch.py Shared)


def _check(ranks: list[dict], cfg: dict) -> None:
    ref = reference(cfg["family"], cfg["tie"], cfg["side"], cfg.get("built", "init"))
    assert_parity(ranks, ref["losses"], ref["state"], rtol=TOL, atol=1e-6)
    for r in ranks:
        assert r["metrics"].keys() == ref["metrics"].keys()
        for key, value in ref["metrics"].items():
            # val_logit_mean is a mean of values near 0: compared absolutely (summation order differs).
            assert r["metrics"][key] == pytest.approx(value, rel=TOL, abs=1e-6), key
    if cfg["tie"]:
        names = ("model.model.embed_tokens.weight", "model.lm_head.weight")
        copies = [r["state"][k] for r in ranks for k in names if k in r["state"]]
        assert len(copies) >= 2 and all(torch.equal(c, copies[0]) for c in copies)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS[2], ids=lambda c: c["name"])
def test_hf_two_processes(two_procs, cfg):
    _check(two_procs.ranks(cfg["name"]), cfg)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS[4], ids=lambda c: c["name"])
def test_hf_four_processes(four_procs, cfg):
    _check(four_procs.ranks(cfg["name"]), cfg)


@pytest.mark.extended
@pytest.mark.slow
def test_hf_stages_sharded_over_replicas_train_as_replicated_ones(four_procs):
    """A later stage of a transformers model starts at its first block under FSDP too (whose pre-forward hook hands
    the block new tensor objects), and trains as DDP replicas of the same stages do."""
    ddp, fsdp = (four_procs.ranks(cfg["name"]) for cfg in REPLICATED)
    assert sorted((r["dp_rank"], r["pipeline_rank"]) for r in fsdp) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    replicas = {r["dp_rank"]: r["losses"] for r in ddp}
    assert replicas[0] != replicas[1]  # the replicas trained on different samples
    for d, f in zip(ddp, fsdp):
        assert (d["dp_rank"], d["pipeline_rank"]) == (f["dp_rank"], f["pipeline_rank"])
        torch.testing.assert_close(torch.tensor(f["losses"]), torch.tensor(d["losses"]), rtol=TOL, atol=1e-6)
        assert f["state"].keys() == d["state"].keys() and d["state"]
        for key, value in d["state"].items():
            torch.testing.assert_close(f["state"][key], value, rtol=TOL, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
        for key, value in d["metrics"].items():
            assert f["metrics"][key] == pytest.approx(value, rel=TOL, abs=1e-6), key


@pytest.mark.extended
@pytest.mark.slow
def test_fsdp_refuses_token_weighting_when_the_replicas_count_different_tokens(four_procs):
    ranks = four_procs.ranks(FSDP_WEIGHTED["name"])
    assert len(ranks) == 4
    for r in ranks:
        assert "the data-parallel replicas counted different items ([" in r["error"], r["error"]
        assert "Use `data_parallel='ddp'`" in r["error"]


def test_token_weighting_is_not_vacuous():
    """Padding makes microbatch token means differ from the batch's: averaging them equally would be off."""
    from torch.nn.functional import cross_entropy

    from tests.hf_models import VOCAB, padded_batches

    ids, _, labels = padded_batches(8, 0, "right").tensors
    logits = torch.randn(8, ids.shape[1], VOCAB, generator=torch.Generator().manual_seed(0))
    shifted, targets = logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)
    whole = cross_entropy(shifted, targets, ignore_index=-100)
    halves = [cross_entropy(s, t, ignore_index=-100) for s, t in zip(shifted.chunk(2), targets.chunk(2))]
    assert abs(float(whole) - float(sum(halves) / 2)) > 10 * TOL
