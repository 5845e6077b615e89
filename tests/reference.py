"""Single-device reference runs (in the pytest process) and comparison helpers for parity tests."""

from __future__ import annotations

import functools
from pathlib import Path

import lightning.pytorch as L
import torch

from tests.models import LitLM


@functools.cache
def single_device_run(
    accumulate: int = 1,
    clip: float | None = None,
    max_steps: int = 6,
    n_layers: int = 8,
    optimizer: str = "sgd",
    precision: str = "32-true",
) -> tuple[list[float], dict]:
    L.seed_everything(0)
    model = LitLM(n_layers=n_layers, optimizer=optimizer)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    return model.step_losses, {k: v.detach().float().clone() for k, v in model.state_dict().items()}


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


@functools.cache
def single_device_model_run(name: str, precision: str = "32-true", max_steps: int = 4) -> tuple[list[float], dict]:
    from tests.models import build_model

    L.seed_everything(0)
    model = build_model(name)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    return model.step_losses, {k: v.detach().float().clone() for k, v in model.state_dict().items()}
