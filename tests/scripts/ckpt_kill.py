"""Kill test (2 ranks): rank 1 is SIGKILLed in the middle of writing a checkpoint; a second launch resumes.

Usage: ckpt_kill.py OUT crash|resume.
- crash: trains 3 epochs saving ``epoch=..`` and ``last.ckpt`` at each epoch end; during the fourth save (epoch 1's
  last.ckpt, replacing epoch 0's), rank 1 kills itself with SIGKILL right after writing its shard, before the save
  completes. The launch fails.
- resume: ``fit(ckpt_path="last")`` to 3 epochs; saves losses and the restored step.
"""

import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as L
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.scripts.ckpt_common import LitLMScheduled, Snapshot, save, strategy, trainer


def kill_rank1_in_fourth_save() -> None:
    original = dcp.FileSystemWriter.write_data
    calls = []

    def write_data(self, plan, planner):
        future = original(self, plan, planner)
        calls.append(1)
        if dist.get_rank() == 1 and len(calls) == 4:
            future.wait()  # the shard is on disk; the save is not complete
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    dcp.FileSystemWriter.write_data = write_data


def main() -> None:
    out, phase = Path(sys.argv[1]), sys.argv[2]
    L.seed_everything(0)
    model = LitLMScheduled()
    snap = Snapshot()
    last = ModelCheckpoint(dirpath=out / "kill", save_last=True, save_top_k=-1, save_on_train_epoch_end=True)
    t = trainer(strategy("1F1B"), max_steps=-1, max_epochs=3, callbacks=[last, snap])
    if phase == "crash":
        kill_rank1_in_fourth_save()
        t.fit(model)
    else:
        t.fit(model, ckpt_path="last")
        save({"losses": model.step_losses, **(snap.taken or {})}, out, "kill-resumed", t.global_rank)


if __name__ == "__main__":
    main()
