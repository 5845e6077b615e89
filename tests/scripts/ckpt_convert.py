"""Conversion scenarios (2 ranks): a pipeline resumes a single-device run, saves a checkpoint for the way back, and
refuses single files it cannot resume from.

Usage: ckpt_convert.py OUT [four], after the pytest side wrote OUT/single.ckpt (one device, 1 epoch of 3 steps, Adam
and a LambdaLR scheduler) and OUT/single-weights.ckpt (the same, weights only). Each rank saves what it saw per
scenario; each error scenario saves the message (or "no error"). With ``four`` (4 ranks): only the resume, on a
pipeline of 4 stages, and a checkpoint of it for the way back.
"""

import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipelineCheckpointError
from tests.scripts.ckpt_common import LitLMScheduled, Snapshot, save, snapshot, strategy, trainer


class LitLMGrouped(LitLMScheduled):
    """Weight decay on weights only: two param groups where the single-device run had one."""

    def configure_optimizers(self):
        named = list(self.named_parameters())
        return torch.optim.AdamW(
            [
                {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
                {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0},
            ],
            lr=self.hparams.lr,
        )


def resume(out: Path, name: str, schedule: str, devices: int = 2) -> None:
    L.seed_everything(0)
    model = LitLMScheduled()
    snap = Snapshot()
    t = trainer(strategy(schedule), devices=devices, max_steps=-1, max_epochs=3, callbacks=[snap])
    t.fit(model, ckpt_path=out / "single.ckpt")
    save({"losses": model.step_losses, **(snap.taken or {})}, out, name, t.global_rank)


def train_and_save(out: Path, name: str, devices: int = 2) -> None:
    L.seed_everything(0)
    model = LitLMScheduled()
    t = trainer(strategy("1F1B"), devices=devices, max_steps=-1, max_epochs=1)
    t.fit(model)
    t.save_checkpoint(out / f"{name}.ckpt")
    save({"losses": model.step_losses, **snapshot(t, model)}, out, f"{name}-saved", t.global_rank)


def expect_error(out: Path, name: str, model: L.LightningModule, ckpt: Path, predict_first: bool = False) -> None:
    L.seed_everything(0)
    if predict_first:  # splits the module outside `fit`
        inputs = TensorDataset(model.train_dataloader().dataset.tensors[0])
        trainer(strategy("1F1B")).predict(model, dataloaders=DataLoader(inputs, batch_size=8))
    t = trainer(strategy("1F1B"), max_steps=-1, max_epochs=3)
    try:
        t.fit(model, ckpt_path=ckpt)
        message = "no error"
    except PipelineCheckpointError as err:
        message = str(err)
    save({"error": message}, out, f"error-{name}", t.global_rank)


def main() -> None:
    out = Path(sys.argv[1])
    if sys.argv[2:] == ["four"]:
        resume(out, "from-single-4ranks", "1F1B", devices=4)
        train_and_save(out, "pipe4", devices=4)
        return
    resume(out, "from-single-1f1b", "1F1B")
    resume(out, "from-single-interleaved", "Interleaved1F1B")  # 4 stages on 2 ranks
    train_and_save(out, "pipe")
    expect_error(out, "weights-only", LitLMScheduled(), out / "single-weights.ckpt")
    expect_error(out, "regrouped", LitLMGrouped(), out / "single.ckpt")
    expect_error(out, "split-before-fit", LitLMScheduled(), out / "single.ckpt", predict_first=True)


if __name__ == "__main__":
    main()
