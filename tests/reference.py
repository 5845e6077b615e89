"""Single-device reference runs (in the pytest process) and comparison helpers for parity tests."""

from __future__ import annotations

import functools
import zlib
from pathlib import Path

import lightning.pytorch as L
import torch
from torch import nn

from tests.models import LitLM, build_model


def _fit_single_device(model: L.LightningModule, **trainer_kwargs) -> tuple[list[float], dict]:
    return _fit_single_device_trainer(model, **trainer_kwargs)[:2]


def _fit_single_device_trainer(model: L.LightningModule, **trainer_kwargs) -> tuple[list[float], dict, dict]:
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
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    logged["step_acc"] = getattr(model, "step_acc", None)
    return model.step_losses, state, logged


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
    return single_device_model_logged(name, precision, max_steps)[:2]


@functools.cache
def single_device_model_logged(name: str, precision: str = "32-true", max_steps: int = 4) -> tuple[list, dict, dict]:
    """As `single_device_model_run`, plus the final `callback_metrics`."""
    L.seed_everything(0)
    return _fit_single_device_trainer(build_model(name), max_steps=max_steps, precision=precision)


class ReplicaBatches:
    """Global batches as data-parallel training sees them: batch k of every replica's DistributedSampler shard
    (shuffled, seeded as Lightning seeds it), concatenated. Averaging the replicas' gradients equals one device
    training on these batches."""

    def __init__(self, size: int, replicas: int, batch_size: int, seed: int = 0) -> None:
        self.size, self.replicas, self.batch_size, self.seed, self.epoch = size, replicas, batch_size, seed, 0
        # Lightning calls `set_epoch` on `batch_sampler.sampler` at each epoch start.
        self.sampler = self

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _shards(self) -> list[list[int]]:
        from torch.utils.data import DistributedSampler

        shards = []
        for rank in range(self.replicas):
            sampler = DistributedSampler(range(self.size), self.replicas, rank, shuffle=True, seed=self.seed)
            sampler.set_epoch(self.epoch)
            shards.append(list(sampler))
        return shards

    def __iter__(self):
        shards = self._shards()
        for start in range(0, len(shards[0]), self.batch_size):
            yield [i for shard in shards for i in shard[start : start + self.batch_size]]

    def __len__(self) -> int:
        return -(-self.size // self.replicas // self.batch_size)


@functools.cache
def single_device_data_parallel_run(
    replicas: int, accumulate: int = 1, clip: float | None = None, max_steps: int = 6, samples: int = 64
) -> tuple[list[float], dict]:
    """LitLM on one device, fed the concatenation of what each data-parallel replica would see."""
    from torch.utils.data import DataLoader

    from tests.models import token_dataset

    L.seed_everything(0)
    model = LitLM(samples=samples)
    dataset = token_dataset(model.hparams.samples)
    batches = ReplicaBatches(len(dataset), replicas, model.hparams.batch_size)
    model.train_dataloader = lambda: DataLoader(dataset, batch_sampler=batches)
    return _fit_single_device(model, max_steps=max_steps, accumulate_grad_batches=accumulate, gradient_clip_val=clip)


def load_ranks(out: Path, name: str) -> list[dict]:
    files = sorted(out.glob(f"{name}.rank*.pt"), key=lambda p: int(p.suffixes[-2][5:]))
    return [torch.load(f, weights_only=False) for f in files]


def merged_state(ranks: list[dict], dp_rank: int = 0) -> dict:
    """Union of the pipeline ranks' states of one data-parallel replica; fails if two ranks hold the same key."""
    merged: dict = {}
    for r in ranks:
        if r["dp_rank"] != dp_rank:
            continue
        # A key on two ranks is allowed only for the copies of a tied parameter, which must be bitwise equal.
        overlap = [k for k in merged.keys() & r["state"].keys() if not torch.equal(merged[k], r["state"][k])]
        assert not overlap, f"parameters held by two pipeline ranks with different values: {sorted(overlap)[:5]}"
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


def assert_data_parallel_parity(ranks: list[dict], accumulate: int, clip: float | None) -> None:
    """2 replicas x 2 stages, each replica on its shard: the replicas' mean loss and every replica's weights equal one
    device on both shards (the global batch)."""
    assert sorted((r["dp_rank"], r["pipeline_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ref_losses, ref_state = single_device_data_parallel_run(2, accumulate=accumulate, clip=clip)
    per_replica = {r["dp_rank"]: r["losses"] for r in ranks}
    assert per_replica[0] != per_replica[1]  # the replicas really saw different data
    mean = [(a + b) / 2 for a, b in zip(per_replica[0], per_replica[1])]
    # The reference's per-step loss is the global batch mean; the replicas' mean equals it; weights equal everywhere.
    assert_parity([{**r, "losses": mean} for r in ranks], ref_losses, ref_state)


def materialize(module: nn.Module, device: torch.device, seed: int) -> None:
    """Reference for ``initialize``: allocate a meta-device module on ``device`` and initialise it with each
    submodule's ``reset_parameters``.

    Each submodule is initialised under its own seed, derived from ``seed`` and its name, so a model gets the same
    initial weights whatever the pipeline layout (and whichever rank holds the submodule).
    """
    module.to_empty(device=device)
    for name, sub in module.named_modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed((seed + zlib.crc32(name.encode())) % (2**63))
                reset()
