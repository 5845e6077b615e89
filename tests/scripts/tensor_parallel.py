"""Tensor parallelism inside pipeline stages (with data parallelism), several scenarios per launch; each rank saves what
it saw per scenario.

Usage: tensor_parallel.py OUT CONFIGS_JSON. A config: {"name", "devices", "pipeline_size", "tensor_parallel",
"schedule", "data_parallel", "accumulate", "clip", "activation_checkpointing", "loss_parallel", "max_steps", "val"
(validation every n steps), "model": "decoder"|"hf"|"pretrained", model options ("plan", "tied", "weighted",
"optimizer", "qk_norm", "build_late", "family"), "save": dir name, "resume": dir name, "init_weights": dir name (a
Hugging Face model directory the test wrote), "error": True (an error is expected: its type and message are saved)}.

Per rank: losses, validation losses, whole parameters and optimizer state at the start (after a resume or an initial
load) and at the end
(DTensor shards gathered), the memory report, the mesh coordinates, as ``<name>.rank<r>.pt``. A config that raises
(unexpectedly) leaves its traceback in ``<name>.rank<r>.failed`` and the next one runs (tests/scripts/outcomes.py).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch

import lightning_pipe
from lightning_pipe.checkpoint import io as ckpt_io
from tests.hf_models import LitHF
from tests.hf_pretrained import LitPretrained
from tests.models import quiet_trainer
from tests.scripts.outcomes import run_each
from tests.tp_models import LitTPDecoder

MODEL_OPTIONS = ("plan", "tied", "weighted", "optimizer", "qk_norm", "build_late", "samples", "shuffle")


def whole(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        return value.detach().float().clone()
    return value


def snapshot(trainer: L.Trainer, module: L.LightningModule) -> dict[str, Any]:
    """Whole tensors under the names a checkpoint uses (collective: every rank of a stage calls it alike)."""
    aliases = trainer.strategy.checkpoint_topology().aliases
    state = {aliases.get(k, k): whole(v) for k, v in module.state_dict().items()}
    optim = {}
    if trainer.optimizers:
        flat = ckpt_io.optimizer_state(module, trainer.optimizers[0], aliases)
        optim = {k: whole(v) for k, v in sorted(flat.items())}
    return {"state": state, "optim": optim}


class Record(L.Callback):
    def __init__(self, resumed: bool) -> None:
        self.resumed = resumed
        self.start: dict[str, Any] | None = None
        self.memory: list[str] = []

    def on_train_start(self, trainer, pl_module):
        if self.resumed:
            self.start = snapshot(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self.memory = trainer.strategy.memory_report.lines()


def build(cfg: dict, out: Path) -> L.LightningModule:
    if cfg.get("model") == "pretrained":  # built from the directory's config in `configure_model`
        return LitPretrained(str(out / cfg["init_weights"]))
    if cfg.get("model") == "hf":
        return LitHF(family=cfg.get("family", "llama"), tie=cfg.get("tied", False), layers=4)
    return LitTPDecoder(**{k: cfg[k] for k in MODEL_OPTIONS if k in cfg})


def run(out: Path, cfg: dict) -> None:
    L.seed_everything(0)
    model = build(cfg, out)
    strategy = lightning_pipe.PipelineParallelStrategy(
        schedule=cfg.get("schedule", "1F1B"),
        pipeline_size=cfg.get("pipeline_size", "auto"),
        tensor_parallel=cfg.get("tensor_parallel", "auto"),
        data_parallel=cfg.get("data_parallel", "ddp"),
        activation_checkpointing=cfg.get("activation_checkpointing", False),
        loss_parallel=cfg.get("loss_parallel", False),
        init_weights=out / cfg["init_weights"] if cfg.get("init_weights") else None,
        timeout=timedelta(seconds=120),
    )
    record = Record(resumed=bool(cfg.get("resume") or cfg.get("init_weights")))
    val = cfg.get("val")
    trainer = quiet_trainer(
        strategy=strategy,
        devices=cfg["devices"],
        max_steps=cfg.get("max_steps", 4),
        accumulate_grad_batches=cfg.get("accumulate", 1),
        gradient_clip_val=cfg.get("clip"),
        val_check_interval=val,
        limit_val_batches=2 if val else 0,
        callbacks=[record],
    )
    result: dict[str, Any] = {}
    try:
        trainer.fit(model, ckpt_path=str(out / cfg["resume"]) if cfg.get("resume") else None)
    except Exception as err:
        if not cfg.get("error"):
            raise
        result["error"] = (type(err).__name__, str(err))
    else:
        if cfg.get("save"):
            trainer.save_checkpoint(out / cfg["save"])
        result.update(
            losses=model.step_losses,
            val_losses=getattr(model, "val_losses", []),
            end=snapshot(trainer, model),
            start=record.start,
            memory=record.memory,
            ranks={
                "pp": strategy.pipeline_rank,
                "dp": strategy.data_parallel_rank,
                "tp": strategy.tensor_parallel_rank,
                "tp_group": torch.distributed.get_process_group_ranks(strategy.tensor_parallel_group),
                "pp_group": torch.distributed.get_process_group_ranks(strategy.pipeline_group),
            },
        )
    torch.save(result, out / f"{cfg['name']}.rank{torch.distributed.get_rank()}.pt")


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    run_each(out, configs, run)


if __name__ == "__main__":
    main()
