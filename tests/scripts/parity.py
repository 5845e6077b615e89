"""Train LitLM under several pipeline configurations in one process group; each rank saves losses and its weights.

Usage: parity.py OUT_DIR CONFIGS_JSON  (a list of {"name", "schedule", "accumulate", "clip", "sabotage", ...}).
Each rank saves ``<name>.rank<r>.pt``; a config that raises leaves its traceback in ``<name>.rank<r>.failed`` and the
next one runs (tests/scripts/outcomes.py).
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as L
import torch

import lightning_pipe
from lightning_pipe.parallel.compile import compiled_blocks
from tests.models import LitLM
from tests.scripts.outcomes import run_each


class DropStageGradients(L.Callback):
    """Fault injection: pipeline rank 1 loses its gradients, as a broken gradient hand-over would."""

    def on_after_backward(self, trainer, pl_module):
        if trainer.strategy.pipeline_rank == 1:
            for p in pl_module.parameters():
                p.grad = None


class Compiled(L.Callback):
    """What the strategy compiled and checkpointed on this rank during training, and whether its teardown gave the
    blocks their own forward back."""

    def on_train_start(self, trainer, pl_module):
        stages = trainer.strategy.runtime.stages.values()
        self.blocks = [name for stage in stages for name in compiled_blocks(stage.body)]
        self.checkpointed = trainer.strategy.checkpointed_blocks

    @staticmethod
    def forwards_left(model):
        return [name for name, sub in model.named_modules() if "forward" in vars(sub)]


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    run_each(out, configs, run)


def run(out: Path, cfg: dict) -> None:
    L.seed_everything(0)
    model = LitLM(n_layers=cfg.get("n_layers", 8), optimizer=cfg.get("optimizer", "sgd"))
    strategy = lightning_pipe.PipelineParallelStrategy(
        schedule=cfg["schedule"],
        pipeline_size=cfg.get("pipeline_size", "auto"),
        microbatches=cfg.get("microbatches", "auto"),
        activation_checkpointing=cfg.get("activation_checkpointing", False),
        compile=cfg.get("compile", False),
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=cfg["devices"],
        num_nodes=cfg.get("num_nodes", 1),
        precision=cfg.get("precision", "32-true"),
        max_steps=cfg.get("max_steps", 6),
        accumulate_grad_batches=cfg.get("accumulate", 1),
        gradient_clip_val=cfg.get("clip"),
        callbacks=[DropStageGradients()] if cfg.get("sabotage") else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    compiled = Compiled()
    trainer.callbacks.append(compiled)
    trainer.fit(model)
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    torch.save(
        {
            "losses": model.step_losses,
            "state": state,
            "logged": logged,
            "pipeline_rank": strategy.pipeline_rank,
            "dp_rank": strategy.data_parallel_rank,
            "compiled": compiled.blocks,
            "checkpointed": compiled.checkpointed,
            "forwards_left": compiled.forwards_left(model),
        },
        out / f"{cfg['name']}.rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
