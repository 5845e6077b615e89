"""Several Trainers, one after another, on the same LightningModule: what a Trainer installs ends with it.

Usage: second_trainer.py OUT_DIR

1. ``fit`` with 1F1B and activation checkpointing, then ``fit`` on the same module with GPipe (the same stages per
   rank: nothing to re-split) and no activation checkpointing, with a model summary: per-step losses, final weights,
   each Trainer's saved-for-backward bytes and checkpointed blocks, and whether a block still has a checkpointing
   forward after each Trainer.
2. A third Trainer whose stages would differ (Interleaved1F1B, two stages per rank): refused, nothing trained.
3. A fresh module whose training loader's last batch 1F1B cannot run as equal microbatches (one sample on two
   stages): that batch runs under GPipe on the same stages, said when ``fit`` starts; per-step losses and weights.
"""

import sys
from pathlib import Path

import lightning.pytorch as L
import torch

import lightning_pipe
from tests.models import LitLM, quiet_trainer


def fit(model: L.LightningModule, summary: bool = False, **strategy_kwargs) -> L.Trainer:
    trainer = quiet_trainer(
        strategy=lightning_pipe.PipelineParallelStrategy(**strategy_kwargs),
        devices=2,
        max_steps=3,
        enable_model_summary=summary,
    )
    trainer.fit(model)
    return trainer


def checkpointing_forwards(model: LitLM) -> int:
    """Blocks of this rank whose forward is still replaced by activation checkpointing."""
    return sum("forward" in vars(block) for block in model.model.modules())


def main() -> None:
    out = Path(sys.argv[1])
    L.seed_everything(0)
    model = LitLM(n_layers=8)
    first = fit(model, schedule="1F1B", activation_checkpointing=True)
    after_first = checkpointing_forwards(model)
    second = fit(model, schedule="GPipe", summary=True)
    rank = first.global_rank
    result = {
        "losses": model.step_losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "pipeline_rank": second.strategy.pipeline_rank,
        "dp_rank": 0,
        "saved": [t.strategy.memory_report.saved_per_microbatch for t in (first, second)],
        "checkpointed": [first.strategy.checkpointed_blocks, second.strategy.checkpointed_blocks],
        "forwards_after": [after_first, checkpointing_forwards(model)],
    }
    try:
        fit(model, schedule="Interleaved1F1B")
    except lightning_pipe.PipelineConfigError as err:
        result["refused"] = str(err)
    result["steps_after_refusal"] = len(model.step_losses)

    L.seed_everything(0)
    short = LitLM(n_layers=8, samples=17)  # batches of 8, 8 and 1: 1F1B on 2 stages needs at least 2 microbatches
    fit(short, schedule="1F1B", microbatches=8)
    result["short_batch_losses"] = short.step_losses
    result["short_batch_state"] = {k: v.detach().clone() for k, v in short.state_dict().items()}
    torch.save(result, out / f"second.rank{rank}.pt")


if __name__ == "__main__":
    main()
