"""A Llama-style decoder (masks and rope tables on every stage, tied embedding/head, token-weighted loss, shuffled
data, a short last batch that some schedules run only under their fallback) trains, validates, tests and predicts as
on one device under all 7 schedules at 2 processes and the main four at 4."""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_pipe.settings import SCHEDULES
from tests.decoder_models import run_decoder
from tests.launch import SHARED_FOUR, SHARED_TWO, Launch
from tests.reference import assert_parity

ALL_SCHEDULES = list(SCHEDULES)
CONFIGS = {
    # The mask goes positionally for half of the schedules and by keyword for the others.
    2: [{"name": f"{s}-2", "schedule": s, "devices": 2, "keyword": i % 2 == 1} for i, s in enumerate(ALL_SCHEDULES)],
    4: [
        {"name": f"{s}-4", "schedule": s, "devices": 4, "keyword": i % 2 == 0}
        for i, s in enumerate(["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
    ],
}
TOL = 1e-5


@functools.cache
def reference(keyword: bool = False, tied: bool = True) -> dict:
    return run_decoder(keyword_mask=keyword, tied=tied)


# The launches' results, collected once per module: each test reads its own config's (Launch.ranks).
SHARED_TWO.part(__name__, "two_procs", "decoder.py", CONFIGS[2])


@pytest.fixture(scope="module")
def two_procs(request) -> Launch:
    return SHARED_TWO.launch(request)  # the 2-process launch shared with other modules (tests/launch.py Shared)


SHARED_FOUR.part(__name__, "four_procs", "decoder.py", CONFIGS[4])


@pytest.fixture(scope="module")
def four_procs(request) -> Launch:
    return SHARED_FOUR.launch(request)  # the 4-process launch shared with other modules (tests/launch.py Shared)


def _check(ranks: list[dict], ref: dict) -> None:
    assert_parity(ranks, ref["losses"], ref["state"], rtol=TOL)
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["val_losses"]), torch.tensor(ref["val_losses"]), rtol=TOL, atol=0)
        assert r["test"] == pytest.approx(ref["test"], rel=TOL)
        assert r["fit_metrics"] == pytest.approx(ref["fit_metrics"], rel=TOL)
    first = [r for r in ranks if r["pipeline_rank"] == 0]
    for r in first:
        # Logits of order 1 from weights equal within TOL: measured up to 5.7e-6 apart (other matmul shapes).
        torch.testing.assert_close(r["predictions"], ref["predictions"], rtol=TOL, atol=TOL)
    assert all(r["predictions"] is None for r in ranks if r["pipeline_rank"] != 0)
    # fit -> test -> predict with one Trainer: the strategy's mesh (and tie groups) serve every entry.
    assert all(len(set(r["process_groups"])) == 1 for r in ranks), [r["process_groups"] for r in ranks]
    # The tied embedding and head: copies on different ranks stay bitwise equal.
    copies = [r["state"][k] for r in ranks for k in ("model.embed.weight", "model.head.weight") if k in r["state"]]
    assert len(copies) >= 2 and all(torch.equal(c, copies[0]) for c in copies)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS[2], ids=lambda c: c["name"])
def test_decoder_two_processes(two_procs, cfg):
    _check(two_procs.ranks(cfg["name"]), reference(cfg["keyword"]))


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS[4], ids=lambda c: c["name"])
def test_decoder_four_processes(four_procs, cfg):
    _check(four_procs.ranks(cfg["name"]), reference(cfg["keyword"]))


def test_the_comparisons_are_not_vacuous():
    """A pipeline that did not sum the tied copies' gradients would train the untied model; one that dropped the
    mask on later stages would see no padding. Both differ from the reference by far more than the tolerance."""
    from tests.decoder_models import Decoder, padded_dataset, rope_tables

    tied, untied = reference(), reference(tied=False)
    assert abs(tied["losses"][-1] - untied["losses"][-1]) > 1e-2
    torch.manual_seed(0)
    model = Decoder()
    idx, mask, _ = padded_dataset(8, seed=0).tensors
    cos, sin = rope_tables(idx.shape[1], 8)
    with torch.no_grad():
        assert (
            model(idx, mask, cos=cos, sin=sin) - model(idx, torch.ones_like(mask), cos=cos, sin=sin)
        ).abs().max() > 1e-2
    assert reference(keyword=True)["losses"] == pytest.approx(tied["losses"], rel=1e-6)
