"""Checkpoint scenarios, part 1 (2 ranks): straight runs, and the first half of each run saved as checkpoints.

Usage: ckpt_train.py OUT. For 1F1B (ModelCheckpoint: top-k directories by train_loss, plus last.ckpt at epoch end) and
Interleaved1F1B (2 stages per rank; ``trainer.save_checkpoint``), each rank saves its losses and its state at save time.
"""

import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from tests.scripts.ckpt_common import LitLMScheduled, save, snapshot, strategy, trainer


def main() -> None:
    out = Path(sys.argv[1])
    for name, schedule in (("1f1b", "1F1B"), ("interleaved", "Interleaved1F1B")):
        L.seed_everything(0)
        model = LitLMScheduled()
        t = trainer(strategy(schedule), max_steps=-1, max_epochs=3)
        t.fit(model)
        save({"losses": model.step_losses}, out, f"{name}-straight", t.global_rank)

        L.seed_everything(0)
        model = LitLMScheduled()
        callbacks = []
        if name == "1f1b":
            callbacks = [
                ModelCheckpoint(dirpath=out / "topk", monitor="train_loss", save_top_k=1, every_n_train_steps=1),
                ModelCheckpoint(dirpath=out / name, save_last=True, save_top_k=-1, save_on_train_epoch_end=True),
            ]
        t = trainer(strategy(schedule), max_steps=-1, max_epochs=1, callbacks=callbacks)
        t.fit(model)
        if name == "interleaved":
            t.save_checkpoint(out / "interleaved.ckpt")
            t.save_checkpoint(out / "weights.ckpt", weights_only=True)
            # The pipeline's predictions of the saved weights (on pipeline rank 0; None elsewhere).
            inputs = TensorDataset(model.train_dataloader().dataset.tensors[0])
            predictions = t.predict(model, dataloaders=DataLoader(inputs, batch_size=8))
            if t.global_rank == 0:
                torch.save(torch.cat(predictions), out / "interleaved-predictions.pt")
        best = callbacks[0].best_model_path if callbacks else None
        save({"losses": model.step_losses, "best": best, **snapshot(t, model)}, out, f"{name}-saved", t.global_rank)


if __name__ == "__main__":
    main()
