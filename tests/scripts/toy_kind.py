"""A model kind added from the tests (tests/toy_kind.py) through a 2-rank pipeline: start from its own directory
(``init_weights``), train, save, resume, save again. Each rank saves what it saw as ``toy.rank<r>.pt``; the pytest
side exports the last checkpoint back to the toy format (tests/test_model_kind_toy.py).

Usage: toy_kind.py WORK (``WORK/start``: a toy model directory).
"""

import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as L
import torch

from lightning_pipe import PipelineParallelStrategy
from lightning_pipe.models import kind_of
from tests.models import quiet_trainer
from tests.toy_kind import LitToy, ToyCell, register


class Snapshot(L.Callback):
    """This rank's weights as training starts (after ``init_weights`` or the resumed checkpoint)."""

    def on_train_start(self, trainer: L.Trainer, module: LitToy) -> None:
        self.state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        self.scales = {name: m.scale.clone() for name, m in module.named_modules() if isinstance(m, ToyCell)}


def fit(work: Path, max_steps: int, **kwargs) -> tuple[LitToy, L.Trainer, Snapshot]:
    L.seed_everything(0)
    model, snap = LitToy(), Snapshot()
    strategy = PipelineParallelStrategy(schedule="1F1B", timeout=timedelta(seconds=60), **kwargs)
    trainer = quiet_trainer(devices=2, max_steps=max_steps, strategy=strategy, callbacks=[snap])
    return model, trainer, snap


def main(work: Path) -> None:
    register()  # every rank runs this script: each registers the kind
    model, trainer, first = fit(work, 2, init_weights=work / "start")
    trainer.fit(model)
    trainer.save_checkpoint(work / "ckpt")
    resumed, trainer2, second = fit(work, 4)
    trainer2.fit(resumed, ckpt_path=work / "ckpt")
    trainer2.save_checkpoint(work / "ckpt-final")
    result = {
        "kind": kind_of(model.net).name,
        "start": first.state,
        "scales": first.scales,
        "after_first": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "losses": model.step_losses,
        "resumed_start": second.state,
        "resumed_at": resumed.started_at,
        "resumed_losses": resumed.step_losses,
        "final": {k: v.detach().clone() for k, v in resumed.state_dict().items()},
    }
    torch.save(result, work / f"toy.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
