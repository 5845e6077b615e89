"""Single-device reference runs (in the pytest process) and comparison helpers for parity tests."""

from __future__ import annotations

import functools
from pathlib import Path

import lightning.pytorch as L
import torch

from tests.models import LitLM, build_model


def _fit_single_device(model: L.LightningModule, **trainer_kwargs) -> tuple[list[float], dict]:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(model)
    return model.step_losses, {k: v.detach().float().clone() for k, v in model.state_dict().items()}


@functools.cache
def single_device_run(
    accumulate: int = 1, clip: float | None = None, max_steps: int = 6, n_layers: int = 8, optimizer: str = "sgd"
) -> tuple[list[float], dict]:
    """LitLM as the parity script trains it, on one device."""
    L.seed_everything(0)
    model = LitLM(n_layers=n_layers, optimizer=optimizer)
    return _fit_single_device(model, max_steps=max_steps, accumulate_grad_batches=accumulate, gradient_clip_val=clip)


@functools.cache
def single_device_model_run(name: str, precision: str = "32-true", max_steps: int = 4) -> tuple[list[float], dict]:
    """A `tests.models.build_model` model as the frontends script trains it, on one device."""
    L.seed_everything(0)
    return _fit_single_device(build_model(name), max_steps=max_steps, precision=precision)


def load_ranks(out: Path, name: str) -> list[dict]:
    files = sorted(out.glob(f"{name}.rank*.pt"), key=lambda p: int(p.suffixes[-2][5:]))
    return [torch.load(f, weights_only=False) for f in files]


def merged_state(ranks: list[dict], dp_rank: int = 0) -> dict:
    """Union of the pipeline ranks' states of one data-parallel replica; fails if two ranks hold the same key."""
    merged: dict = {}
    for r in ranks:
        if r["dp_rank"] != dp_rank:
            continue
        overlap = merged.keys() & r["state"].keys()
        assert not overlap, f"parameters held by two pipeline ranks: {sorted(overlap)[:5]}"
        merged.update(r["state"])
    return merged


def assert_parity(
    ranks: list[dict], ref_losses: list[float], ref_state: dict, rtol: float = 1e-5, atol: float = 1e-7
) -> None:
    """Per-step losses on every rank and the merged final parameters equal the single-device run."""
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    replicas = {r["dp_rank"] for r in ranks}
    for dp in replicas:
        state = merged_state(ranks, dp)
        assert state.keys() == ref_state.keys()
        for key in ref_state:
            torch.testing.assert_close(
                state[key], ref_state[key], rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}"
            )
