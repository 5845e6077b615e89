"""Families whose layers read per-layer inputs (Gemma 4; Gemma 3n, with AltUp) under the pipeline at 2 processes, in
one launch.

Usage: per_layer.py WORK FAMILY [FAMILY ...]. WORK holds ``<family>-pretrained`` for each family (written by the
pytest side with ``save_pretrained``). Each rank saves ``<family>-<name>.rank<r>.pt``: ``train-<schedule>`` trains
and validates the tiny model (tests/hf_models.py) under 1F1B and ZBVZeroBubble; ``pretrained`` fine-tunes from the
directory with ``init_weights`` under 1F1B (:data:`STEPS` steps) and saves the checkpoint ``<family>-ckpt`` for
``export-hf``.
"""

import sys
from pathlib import Path

import torch

from lightning_pipe import PipelineParallelStrategy
from tests.hf_models import run_hf
from tests.hf_pretrained import fine_tune

#: Fine-tuning steps from the directory. The tiny Gemma 4 is ill-conditioned: weights 1e-7 apart (float summation
#: order) give logits 3e-5 apart, and four steps grow the pipeline's 1e-7 differences to 1e-6; after two, the
#: exported model's logits are within 4e-6 of the one-device fine-tune's.
STEPS = 2


def run_family(work: Path, family: str) -> None:
    for schedule in ("1F1B", "ZBVZeroBubble"):
        # the even split: the timed one may leave the last stage only the head (refused for transformers models)
        strategy = PipelineParallelStrategy(schedule=schedule, balance="blocks")
        result = run_hf(strategy, devices=2, family=family, tie=False, layers=4)
        rank = torch.distributed.get_rank()
        torch.save(result, work / f"{family}-train-{schedule}.rank{rank}.pt")
    path = work / f"{family}-pretrained"
    strategy = PipelineParallelStrategy(schedule="1F1B", init_weights=path)
    model, trainer = fine_tune(path, strategy, devices=2, max_steps=STEPS)
    keys = sorted(model.state_dict())
    torch.save({"losses": model.step_losses, "keys": keys}, work / f"{family}-pretrained.rank{trainer.global_rank}.pt")
    trainer.save_checkpoint(work / f"{family}-ckpt")


def main() -> None:
    work = Path(sys.argv[1])
    for family in sys.argv[2:]:
        run_family(work, family)


if __name__ == "__main__":
    main()
