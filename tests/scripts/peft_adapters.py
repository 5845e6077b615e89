"""Fine-tune tiny pretrained directories with PEFT adapters under the pipeline, from the directory (``init_weights``).

Usage: peft_adapters.py WORK SCHEDULE DEVICES RUN [RUN ...], each RUN ``<directory>:<tuner>`` (directories in WORK,
written by the pytest side with ``save_pretrained`` in several shards; tuners of :data:`tests.peft_models.TUNERS`).
Each rank saves per run its losses, validation loss, the trainable tensors it started from and whether its frozen
tensors are bitwise unchanged, as ``<schedule>-<directory>-<tuner>.rank<r>.pt``, and the run's checkpoint as
``ckpt-<schedule>-<directory>-<tuner>``.
"""

import sys
from pathlib import Path

import torch

from lightning_pipe import PipelineParallelStrategy
from tests.peft_models import fine_tune


def main() -> None:
    work, schedule, devices = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    for run in sys.argv[4:]:
        name, tuner = run.split(":")
        strategy = PipelineParallelStrategy(schedule=schedule, init_weights=work / name)
        model, trainer, val = fine_tune(work / name, tuner, strategy, devices=devices)
        grads = {n for n, p in model.named_parameters() if p.grad is not None}
        state = trainer.optimizers[0].state
        result = {
            "losses": model.step_losses,
            "val": val,
            "initial": model.initial,
            "frozen": sorted(model.frozen),
            "frozen_unchanged": all(torch.equal(model.frozen[n], v) for n, v in model.frozen_after.items()),
            "frozen_loaded": {n: v for n, v in model.frozen.items()},
            "with_grad": sorted(grads),
            "optimizer_state": len(state),
            "trainable": len(model.initial),
        }
        result["final"] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        torch.save(result, work / f"{schedule}-{name}-{tuner}.rank{trainer.global_rank}.pt")
        trainer.save_checkpoint(work / f"ckpt-{schedule}-{name}-{tuner}")


if __name__ == "__main__":
    main()
