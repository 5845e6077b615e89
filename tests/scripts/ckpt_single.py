"""Checkpoint scenarios, part 3 (one process, pipeline_size=1 through the same strategy): load a checkpoint saved
by 2 ranks x 2 stages, record the restored state, and train on.

Usage: ckpt_single.py OUT, after ckpt_train.py OUT.
"""

import sys
from pathlib import Path

import lightning.pytorch as L

from tests.scripts.ckpt_common import LitLMScheduled, Snapshot, save, strategy, trainer


def main() -> None:
    out = Path(sys.argv[1])
    L.seed_everything(0)
    model = LitLMScheduled()
    snap = Snapshot()
    t = trainer(strategy("1F1B", pipeline_size=1), devices=1, max_steps=-1, max_epochs=3, callbacks=[snap])
    t.fit(model, ckpt_path=out / "interleaved.ckpt")
    save({"losses": model.step_losses, **(snap.taken or {})}, out, "single-resumed", t.global_rank)


if __name__ == "__main__":
    main()
