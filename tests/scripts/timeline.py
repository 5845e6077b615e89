"""PipelineTimeline under several schedules in one process group; each rank saves what the callback measured.

Usage: timeline.py OUT_DIR CONFIGS_JSON  (a list of {"name", "schedule", "model", "microbatches", "steps"}; the models
are the benchmark networks of benchmarks/common.py).
"""

import dataclasses
import json
import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.loggers import CSVLogger

import lightning_pipe
from benchmarks.common import MODELS
from benchmarks.lit import BenchModule
from lightning_pipe.callbacks import PipelineTimeline


class KeepStages(L.Callback):
    """The rank's stage modules (the runtime is closed at teardown)."""

    def on_train_start(self, trainer, pl_module):
        self.stages = dict(trainer.strategy.runtime.stages)


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.set_num_threads(1)
    for cfg in configs:
        spec = MODELS[cfg["model"]]
        # The default directory for one configuration (<log_dir>/timeline), an explicit one for the others.
        dirpath = None if cfg["name"] == "1f1b" else out / cfg["name"]
        timeline = PipelineTimeline(dirpath=dirpath, trace_steps=2, skip_steps=1, log_every_n_steps=2)
        strategy = lightning_pipe.PipelineParallelStrategy(schedule=cfg["schedule"], microbatches=cfg["microbatches"])
        keep = KeepStages()
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=2,
            max_steps=cfg["steps"],
            callbacks=[timeline, keep],
            limit_val_batches=0,
            logger=CSVLogger(str(out / cfg["name"]), name="logs"),
            log_every_n_steps=2,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(BenchModule(spec, spec.batch, cfg["steps"], log=True))
        result = {
            "bubbles": timeline.bubbles,
            "theory": timeline.theory,
            "explanation": dataclasses.asdict(timeline.explanation) if timeline.explanation else None,
            "files": [str(f) for f in timeline.files],
            "detached": all(s.recorder is None for s in keep.stages.values()),
            "stages": sorted(keep.stages),
            "log_dir": trainer.log_dir,
        }
        torch.save(result, out / f"{cfg['name']}.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
