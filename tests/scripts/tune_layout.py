"""``lightning_pipe.tune`` searching the layout at 4 processes: a small model whose copies fit, where plain data
parallelism should win; the applied choice trains with the global batch kept; the record is reused without a trial;
the LightningCLI config trains. A margin of 0.5 gives every layout a trial (at the default 0.1, on a busy machine
the model pruned them after the first).

Usage: tune_layout.py OUT_DIR. Each rank saves what it saw to OUT_DIR/tune_layout.rank<r>.pt.
"""

import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.cli import LightningCLI

import lightning_pipe
from lightning_pipe import SearchSpace
from tests.models import LitLM, quiet_trainer

SPACE = SearchSpace(
    schedules=("1F1B",),
    microbatches=(1, 2, 4),
    activation_checkpointing=(0,),
    pipeline_sizes="auto",
    data_parallel=("ddp", "fsdp"),
)


def strategy_layout(trainer: L.Trainer) -> tuple:
    s = trainer.strategy.settings
    return (s.pipeline_size, s.data_parallel_size, s.data_parallel, s.schedule, s.microbatches)


def main() -> None:
    out = Path(sys.argv[1])
    L.seed_everything(0)
    model = LitLM(n_layers=4, batch_size=8)
    trainer = quiet_trainer(strategy="pipeline", devices=4, max_steps=2, default_root_dir=str(out))
    first = lightning_pipe.tune(
        trainer, model, space=SPACE, steps=2, warmup_steps=1, max_trials=5, confirm=0, margin=0.5
    )
    trainer.fit(model)
    ran = (strategy_layout(trainer), model.hparams.batch_size, trainer.global_step)

    fresh = LitLM(n_layers=4, batch_size=8)
    again = lightning_pipe.tune(
        quiet_trainer(strategy="pipeline", devices=4, default_root_dir=str(out)), fresh, space=SPACE
    )

    yaml_file = str(first.files[1])
    cli = LightningCLI(
        LitLM,
        run=False,
        save_config_callback=None,
        args=[
            "--config",
            yaml_file,
            "--model.n_layers=4",
            "--trainer.accelerator=cpu",
            "--trainer.devices=4",
            "--trainer.max_steps=2",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={out / 'cli'}",
        ],
    )
    cli.trainer.fit(cli.model)

    torch.save(
        {
            "choice": first.choice,
            "settings": first.settings,
            "batch_size": first.batch_size,
            "notes": first.notes,
            "rows": [(r.candidate, r.status, r.measured.step if r.measured else None) for r in first.rows],
            "table": first.table,
            "files": [str(f) for f in first.files],
            "ran": ran,
            "again": (again.reused, again.choice, again.batch_size, fresh.hparams.batch_size),
            "cli": (strategy_layout(cli.trainer), cli.model.hparams.batch_size, cli.trainer.global_step),
        },
        out / f"tune_layout.rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
