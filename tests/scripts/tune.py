"""``lightning_pipe.tune`` at 2 processes: trials, the table, the applied choice, the record reused, the memory limit;
a strategy given a schedule of its own (the exported 1F1B as a CSV) tuned over activation checkpointing.

Usage: tune.py OUT_DIR. Each rank saves what it saw to OUT_DIR/tune.rank<r>.pt.
"""

import os
import sys
from pathlib import Path

import lightning.pytorch as L
import torch

import lightning_pipe
from lightning_pipe import PipelineConfigError, PipelineParallelStrategy, SearchSpace
from lightning_pipe.schedules import export_schedule
from tests.models import LitLM, quiet_trainer


def main() -> None:
    out = Path(sys.argv[1])
    csv = out / "1f1b.csv"
    # Each rank runs this line (rank 1 once Lightning starts it): an atomic replace, so no rank reads half a file.
    export_schedule("1F1B", 2, 4, out / f"1f1b.{os.getpid()}.tmp")
    os.replace(out / f"1f1b.{os.getpid()}.tmp", csv)
    L.seed_everything(0)
    model = LitLM(n_layers=4)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    space = SearchSpace(
        schedules=("GPipe", "1F1B", "ZBVZeroBubble"), microbatches=(2, 4), activation_checkpointing=(0, 1)
    )
    trainer = quiet_trainer(strategy="pipeline", devices=2, max_steps=2, default_root_dir=str(out))
    rng = torch.get_rng_state()
    first = lightning_pipe.tune(trainer, model, space=space, steps=2, warmup_steps=1, max_trials=3, confirm=2)
    rng_kept = torch.equal(rng, torch.get_rng_state())
    untouched = all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    trainer.fit(model)
    ran = (trainer.strategy.schedule_name, trainer.strategy.settings.microbatches)

    again = lightning_pipe.tune(
        quiet_trainer(strategy="pipeline", devices=2, default_root_dir=str(out)), LitLM(n_layers=4), space=space
    )

    try:
        lightning_pipe.tune(
            quiet_trainer(strategy="pipeline", devices=2, default_root_dir=str(out)),
            LitLM(n_layers=4),
            space=space,
            steps=1,
            warmup_steps=1,
            max_trials=2,
            memory_limit=1024,
            retune=True,
        )
        limited = None
    except PipelineConfigError as err:
        limited = str(err)

    own = lightning_pipe.tune(
        quiet_trainer(strategy=PipelineParallelStrategy(schedule=str(csv)), devices=2, default_root_dir=str(out)),
        LitLM(n_layers=4),
        space=SearchSpace(activation_checkpointing=(0, 1)),
        steps=1,
        warmup_steps=1,
        max_trials=2,
        margin=10.0,  # both candidates are measured, however far apart predicted
        confirm=0,
        path=out / "own_schedule",
    )

    torch.save(
        {
            "choice": first.choice,
            "settings": first.settings,
            "cost": first.cost,
            "sureness": first.sureness,
            "rows": [(r.candidate, r.status, r.measured.trials if r.measured else 0) for r in first.rows],
            "table": first.table,
            "files": [str(f) for f in first.files],
            "rng_kept": rng_kept,
            "untouched": untouched,
            "ran": ran,
            "again": (again.reused, again.choice, again.settings),
            "limited": limited,
            "notes": first.notes,
            "own": (
                [(r.candidate.label, r.candidate.schedule.path, r.measured is not None) for r in own.rows],
                own.settings,
            ),
            # rank 0 writes the files
            "own_config": own.files[1].read_text() if trainer.global_rank == 0 else None,
        },
        out / f"tune.rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
