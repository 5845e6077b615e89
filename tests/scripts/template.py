"""The project-template LightningModule (network as an ``__init__`` argument, kept in ``save_hyperparameters()``)
under the pipeline: fit with ModelCheckpoint, copies of the fitted module, resume from ``last.ckpt``, test. Each rank
saves what it saw.

Usage: template.py OUT_DIR CONFIGS_JSON (a list of {"name", strategy kwargs...}). A config that raises leaves its
traceback in ``<name>.rank<r>.failed`` and the next one runs (tests/scripts/outcomes.py).
"""

import json
import logging
import sys
import warnings
from pathlib import Path

import torch

import lightning_pipe
from tests.scripts.outcomes import run_each
from tests.template_models import CopyDuringFit, copies, held_out_loader, loaders, new_module, trainer


class Notices(logging.Handler):
    """The info messages Lightning's logger shows (rank 0's ``rank_zero_info``)."""

    def __init__(self) -> None:
        super().__init__()
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    run_each(out, configs, run)


def run(out: Path, cfg: dict) -> None:
    name = cfg.pop("name")
    root = out / name
    model = new_module()
    first = trainer(root, lightning_pipe.PipelineParallelStrategy(**cfg), devices=2, max_epochs=2)
    notices = Notices()
    logging.getLogger("lightning.pytorch").addHandler(notices)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first.fit(model, **loaders())
    logging.getLogger("lightning.pytorch").removeHandler(notices)
    records, tested = model.records, first.test(model, held_out_loader(), verbose=False)[0]
    during = next(c for c in first.callbacks if isinstance(c, CopyDuringFit)).found
    last = first.checkpoint_callback.last_model_path
    resumed = new_module()
    second = trainer(root, lightning_pipe.PipelineParallelStrategy(**cfg), devices=2, max_epochs=3)
    # The checkpoint holds the pickled network (as on one device): loading it needs `weights_only=False`.
    second.fit(resumed, ckpt_path=last, weights_only=False, **loaders())
    torch.save(
        {
            "records": records,
            "test": tested,
            "resumed_records": resumed.records,
            "resumed_test": second.test(resumed, held_out_loader(), verbose=False)[0],
            "warnings": [str(w.message) for w in caught if "BatchNorm" in str(w.message)],
            "batch_notices": [text for text in notices.said if "optimizer step trains on" in text],
            "best": first.checkpoint_callback.best_model_path,
            "during_fit": during,
            "after_fit": copies(model),
        },
        out / f"{name}.rank{first.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
