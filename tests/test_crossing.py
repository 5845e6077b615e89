"""Networks whose values cross more than one stage pipeline exactly with ``frontend="dataflow"``: Lightning's demo
``LightningTransformer`` (an nn.Transformer encoder-decoder: the encoder's output feeds every decoder layer), a U-Net
(skip connections) and transformers' T5Gemma, each under 1F1B and ZBVZeroBubble at 2 processes, and T5Gemma started from
a `save_pretrained` directory (`init_weights`); training, validation and predict against one device."""

from __future__ import annotations

import functools

import lightning.pytorch as L
import pytest
import torch

from tests.crossing_models import MICROBATCHES, MODELS, accumulated_demo, fit_validate_predict
from tests.launch import SHARED_TWO, Launch
from tests.reference import assert_parity

# Starts processes: left out of the fast tier (`pytest -m 'not slow'`).
pytestmark = pytest.mark.slow

CONFIGS = [
    {"name": f"{model}-{schedule}", "model": model, "schedule": schedule}
    for model in ("demo", "unet", "t5gemma")
    for schedule in ("1F1B", "ZBVZeroBubble")
] + [{"name": "t5gemma-pretrained-1F1B", "model": "t5gemma", "schedule": "1F1B", "init_weights": "t5gemma-seed1"}]
TOL = 1e-5


def _seed1_weights(model: str) -> dict:
    torch.manual_seed(1)
    return MODELS[model]().state_dict()


@functools.cache
def reference(model: str, pretrained: bool = False) -> dict:
    start = _seed1_weights(model) if pretrained else None  # before seeding: the data order follows the seed
    L.seed_everything(0)
    network = MODELS[model]()
    if start is not None:  # what the pipeline loads from the directory, in place of the model's own init
        network.load_state_dict(start)
    return fit_validate_predict(network)


def _write_start(out) -> None:
    """The directory the "pretrained" scenarios start from, in the launch's folder."""
    torch.manual_seed(1)
    MODELS["t5gemma"]().model.save_pretrained(out / "t5gemma-seed1")


SHARED_TWO.part(__name__, "two_procs", "crossing.py", CONFIGS, prepare=_write_start)


@pytest.fixture(scope="module")
def two_procs(request) -> Launch:
    pytest.importorskip("transformers")
    return SHARED_TWO.launch(request)  # the 2-process launch shared with other modules (tests/launch.py Shared)


@pytest.mark.extended
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c["name"])
def test_crossing_two_processes(two_procs, cfg):
    ranks = two_procs.ranks(cfg["name"])
    ref = reference(cfg["model"], pretrained="init_weights" in cfg)
    if cfg["model"] == "demo":
        # The demo's own SGD (lr=0.1) turns the other summation order of microbatches (~1e-7) into weights 1.4e-6
        # apart from one whole batch after 4 steps, and predictions up to 7e-5 (measured, and alike between one
        # device with and without accumulation): weights, final validation and predictions are compared with one
        # device accumulating the same microbatches, losses and validation during fit with the whole batch.
        for r in ranks:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=TOL, atol=0)
        ref = {**ref, **accumulated_demo(MICROBATCHES)}
    assert_parity(ranks, ref["losses"], ref["state"], rtol=TOL, atol=1e-7)
    for r in ranks:
        assert r["metrics"].keys() == ref["metrics"].keys()
        for key, value in ref["metrics"].items():
            assert r["metrics"][key] == pytest.approx(value, rel=TOL, abs=1e-6), key
        assert r["validated"][0].keys() == ref["validated"][0].keys()
        for key, value in ref["validated"][0].items():
            assert r["validated"][0][key] == pytest.approx(value, rel=TOL, abs=1e-6), key
    first = next(r for r in ranks if r["pipeline_rank"] == 0)
    others = [r for r in ranks if r["pipeline_rank"] != 0]
    assert len(first["predictions"]) == len(ref["predictions"]) and all(
        p is None for r in others for p in r["predictions"]
    )
    for got, want in zip(first["predictions"], ref["predictions"]):
        torch.testing.assert_close(got, want, rtol=TOL, atol=1e-5)
