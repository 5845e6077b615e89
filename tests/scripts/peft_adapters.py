"""Fine-tune tiny pretrained directories with PEFT adapters under the pipeline, from the directory (``init_weights``).

Usage: peft_adapters.py WORK SCHEDULE DEVICES RUN [RUN ...], each RUN ``<directory>:<tuner>`` (directories in WORK,
written by the pytest side with ``save_pretrained`` in several shards; tuners of :data:`tests.peft_models.TUNERS`).
Each rank saves per run its losses, validation loss, the trainable tensors it started from and whether its frozen
tensors are bitwise unchanged, as ``<schedule>-<directory>-<tuner>.rank<r>.pt``, and the run's checkpoint as
``ckpt-<schedule>-<directory>-<tuner>``.

A RUN ``<directory>:<tuner>:continue`` then continues the fine-tune in a second Trainer: rank 0 exports the
checkpoint's adapters (``export-hf --adapter``) to ``adapter-<schedule>-<directory>-<tuner>``, and a new run starts
from the directory and that adapter directory (``init_adapter``) for 2 steps; each rank saves its losses, validation
loss and the trainable tensors it started from as ``continued-<schedule>-<directory>-<tuner>.rank<r>.pt``.

A RUN ``<directory>:<tuner>:bare`` fine-tunes with the steps of a one-device script: the model's own loss returned
and logged as it is (no ``num_items``); its outcome is named ``<schedule>-<directory>-<tuner>-bare``.

A run that raises leaves its traceback in ``<schedule>-<directory>-<tuner>.rank<r>.failed`` and the next run goes on
(tests/scripts/outcomes.py).
"""

import sys
from pathlib import Path

import torch

from lightning_pipe import PipelineParallelStrategy
from tests.peft_models import fine_tune
from tests.scripts.outcomes import run_each


def main() -> None:
    work, schedule, devices = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    configs = [{"name": f"{schedule}-{label(run)}", "run": run} for run in sys.argv[4:]]
    run_each(work, configs, lambda work, cfg: fine_tune_run(work, schedule, devices, cfg["run"]))


def label(run: str) -> str:
    """A run's name in its outcome files: ``<directory>-<tuner>``, with ``-bare`` for a bare run."""
    name, tuner, *then = run.split(":")
    return f"{name}-{tuner}" + ("-bare" if then == ["bare"] else "")


def fine_tune_run(work: Path, schedule: str, devices: int, run: str) -> None:
    name, tuner, *then = run.split(":")
    strategy = PipelineParallelStrategy(schedule=schedule, init_weights=work / name)
    model, trainer, val = fine_tune(work / name, tuner, strategy, devices=devices, bare=then == ["bare"])
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
    torch.save(result, work / f"{schedule}-{label(run)}.rank{trainer.global_rank}.pt")
    trainer.save_checkpoint(work / f"ckpt-{schedule}-{label(run)}")
    if then == ["continue"]:
        _continue(work, schedule, devices, name, tuner, trainer)


def _continue(work: Path, schedule: str, devices: int, name: str, tuner: str, trainer) -> None:
    from lightning_pipe.checkpoint import export

    adapter = work / f"adapter-{schedule}-{name}-{tuner}"
    if trainer.global_rank == 0:
        export.export(work / f"ckpt-{schedule}-{name}-{tuner}", adapter, adapter=True)
    trainer.strategy.barrier()
    strategy = PipelineParallelStrategy(schedule=schedule, init_weights=work / name, init_adapter=adapter)
    model, trainer, val = fine_tune(work / name, tuner, strategy, devices=devices, max_steps=2)
    result = {"losses": model.step_losses, "val": val, "initial": model.initial}
    torch.save(result, work / f"continued-{schedule}-{name}-{tuner}.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
