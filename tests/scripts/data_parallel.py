"""Data parallel x pipeline scenarios (``data_parallel="ddp"|"fsdp"``, mesh layouts, activation checkpointing),
several per launch; each rank saves what it saw per scenario, or the scenario's traceback (tests/scripts/outcomes.py).

Usage: data_parallel.py OUT CONFIGS_JSON. A config: {"name", "devices", "pipeline_size", "data_parallel", "schedule",
"accumulate", "clip", "inner_axis", "num_nodes", "activation_checkpointing", "bucket_bytes", "max_steps", "precision",
"model": "lm"|"scheduled"|"eval"|"weighted"|"manual", "samples" (training set size), "save": dir name,
"resume": dir name, "validate": bool}.

Per rank: losses, the full parameters and optimizer state (DTensor shards gathered), the gradient collectives over the
data-parallel group per optimizer step, optimizer-state bytes, the mesh groups.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lightning_pipe
from lightning_pipe.checkpoint import io as ckpt_io
from lightning_pipe.measure import memory
from tests.eval_models import LitEvalLM
from tests.models import VOCAB, LitLM
from tests.scripts.ckpt_common import LitLMScheduled
from tests.scripts.outcomes import run_each

#: torch.distributed calls that move gradients (DDP buckets: all_reduce; FSDP: reduce_scatter_single) or gather
#: FSDP parameters (all_gather_single); counted per group.
COUNTED = (
    "all_reduce",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_gather_single",
    "all_gather_into_tensor",
)
CALLS: Counter = Counter()


def _count_calls() -> None:
    for name in COUNTED:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counting(*args: Any, _original=original, _name=name, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ("world",)
            CALLS[(_name, ranks)] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counting)


def _full(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        return value.detach().float().clone()
    return value


def full_snapshot(trainer: L.Trainer, module: L.LightningModule) -> dict[str, Any]:
    """Whole tensors (collective for sharded ones: every rank of a data-parallel group calls it in the same order)."""
    state = {k: _full(v) for k, v in module.state_dict().items()}
    optim = {}
    if trainer.optimizers:
        flat = ckpt_io.optimizer_state(module, trainer.optimizers[0])
        optim = {k: _full(v) for k, v in sorted(flat.items())}
    return {"state": state, "optim": optim, "global_step": trainer.global_step}


class Record(L.Callback):
    """Collectives per optimizer step over the data-parallel group, optimizer-state bytes, the resumed state."""

    def __init__(self) -> None:
        self.per_step: list[dict[str, int]] = []
        self.buckets: list[int] = []
        self.optimizer_bytes = 0
        self.units = 0
        self.resumed: dict[str, Any] | None = None

    def on_train_start(self, trainer, pl_module):
        self.resumed = full_snapshot(trainer, pl_module)
        CALLS.clear()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        dp_ranks = tuple(collective_ranks(trainer.strategy.data_parallel_group))
        self.per_step.append({name: n for (name, ranks), n in CALLS.items() if ranks == dp_ranks})
        self.buckets.append(trainer.strategy.gradient_sync.last_buckets)
        CALLS.clear()

    def on_train_end(self, trainer, pl_module):
        self.optimizer_bytes = memory.state_bytes(pl_module, trainer.optimizers).optimizer_state
        self.units = fsdp_units(trainer.strategy)


class BucketSize(L.Callback):
    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes

    def on_fit_start(self, trainer, pl_module):
        trainer.strategy.gradient_sync.bucket_bytes = self.bucket_bytes


def collective_ranks(group: Any) -> list[int]:
    return dist.get_process_group_ranks(group)


def fsdp_units(strategy: Any) -> int:
    """FSDP units of this rank's stages that hold parameters of their own (each reduce-scatters once)."""
    from torch.distributed.fsdp import FSDPModule

    units = 0
    for stage in strategy.runtime.stages.values():
        for module in stage.modules():
            if not isinstance(module, FSDPModule):
                continue
            nested = {
                id(p) for m in module.modules() if m is not module and isinstance(m, FSDPModule) for p in m.parameters()
            }
            units += any(id(p) not in nested for p in module.parameters())
    return units


class WeightedLM(LitLM):
    """Token-weighted steps: ``training_step`` returns ``num_items``."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))
        return {"loss": loss, "num_items": torch.tensor(y.numel())}


class ManualLM(LitLM):
    """Manual optimization doing what ``accumulate_grad_batches=every, gradient_clip_val=clip`` does automatically:
    each batch's loss divided by ``every`` and back-propagated, then every ``every``-th batch the gradients clipped,
    stepped and zeroed."""

    def __init__(self, every: int, clip: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.every, self.clip = every, clip

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))
        self.manual_backward(loss / self.every)
        if (batch_idx + 1) % self.every == 0:
            self.clip_gradients(opt, self.clip, "norm")
            opt.step()
            opt.zero_grad()
        self.log("train_loss", loss, prog_bar=True)
        return loss


def build(cfg: dict) -> L.LightningModule:
    kind = cfg.get("model", "lm")
    if kind == "manual":  # accumulation and clipping are the module's: the Trainer gets neither
        every, clip = cfg.pop("accumulate"), cfg.pop("clip")
        return ManualLM(every, clip, samples=cfg.get("samples", 64))
    if kind == "scheduled":
        return LitLMScheduled()
    if kind == "eval":
        return LitEvalLM(sync_dist=True, val_samples=16)
    if kind == "weighted":
        return WeightedLM(samples=cfg.get("samples", 64))
    return LitLM(optimizer=cfg.get("optimizer", "sgd"), samples=cfg.get("samples", 64))


def run(out: Path, cfg: dict) -> None:
    L.seed_everything(0)
    model = build(cfg)
    strategy = lightning_pipe.PipelineParallelStrategy(
        schedule=cfg.get("schedule", "1F1B"),
        pipeline_size=cfg.get("pipeline_size", "auto"),
        data_parallel=cfg.get("data_parallel", "ddp"),
        inner_axis=cfg.get("inner_axis", "dp"),
        activation_checkpointing=cfg.get("activation_checkpointing", False),
        timeout=timedelta(seconds=120),
    )
    record = Record()
    callbacks: list = [record]
    if cfg.get("bucket_bytes"):
        callbacks.append(BucketSize(cfg["bucket_bytes"]))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=cfg["devices"],
        num_nodes=cfg.get("num_nodes", 1),
        precision=cfg.get("precision", "32-true"),
        max_steps=cfg.get("max_steps", 6),
        accumulate_grad_batches=cfg.get("accumulate", 1),
        gradient_clip_val=cfg.get("clip"),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    ckpt = str(out / cfg["resume"]) if cfg.get("resume") else None
    error = None
    try:
        trainer.fit(model, ckpt_path=ckpt)
    except lightning_pipe.PipelineConfigError as err:  # an expected error is the scenario's result; the next one runs
        error = str(err)
    if cfg.get("save"):
        trainer.save_checkpoint(out / cfg["save"])
    final = full_snapshot(trainer, model) if error is None else {"state": {}, "optim": {}}
    validated = trainer.validate(model, verbose=False)[0] if cfg.get("validate") else None
    torch.save(
        {
            "losses": model.step_losses,
            "state": final["state"],
            "optim": final["optim"],
            "resumed": record.resumed if ckpt else None,
            "per_step": record.per_step,
            "buckets": record.buckets,
            "units": record.units,
            "checkpointed": strategy.checkpointed_blocks,
            "optimizer_bytes": record.optimizer_bytes,
            "pipeline_rank": strategy.pipeline_rank,
            "dp_rank": strategy.data_parallel_rank,
            "global_rank": trainer.global_rank,
            "node_rank": trainer.node_rank,
            "dp_group": collective_ranks(strategy.data_parallel_group),
            "pp_group": collective_ranks(strategy.pipeline_group),
            "logged": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "validated": validated,
            "error": error,
        },
        out / f"{cfg['name']}.rank{trainer.global_rank}.pt",
    )


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    _count_calls()
    run_each(out, configs, run)


if __name__ == "__main__":
    main()
