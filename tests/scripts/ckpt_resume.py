"""Checkpoint scenarios, part 2 (2 ranks, a new process group): resume, reshard, initial weights, and errors.

Usage: ckpt_resume.py OUT, after ckpt_train.py OUT and the pytest side's preparation of OUT/pretrained.pt,
OUT/single.ckpt and the corrupted copies OUT/corrupt-*.ckpt. Each rank saves what it saw per scenario; each error
scenario saves the message (or "no error").
"""

import sys
from pathlib import Path

import lightning.pytorch as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipe import PipelineCheckpointError
from tests.scripts.ckpt_common import LitLMScheduled, Snapshot, save, strategy, trainer


def resume(out: Path, name: str, schedule: str, ckpt_path: str, callbacks: list | None = None, **kwargs) -> None:
    L.seed_everything(0)
    model = LitLMScheduled()
    snap = Snapshot()
    t = trainer(strategy(schedule, **kwargs), max_steps=-1, max_epochs=3, callbacks=[*(callbacks or []), snap])
    t.fit(model, ckpt_path=ckpt_path)
    save({"losses": model.step_losses, **(snap.taken or {})}, out, name, t.global_rank)


def first_step(out: Path, name: str, init_weights: Path) -> None:
    L.seed_everything(1)  # another seed: the model's own initialisation must not be what is trained
    model = LitLMScheduled()
    snap = Snapshot()
    t = trainer(strategy("1F1B", init_weights=init_weights), max_steps=1, callbacks=[snap])
    t.fit(model)
    save({"losses": model.step_losses, **(snap.taken or {})}, out, name, t.global_rank)


def expect_error(out: Path, name: str, n_layers: int = 8, ckpt_path=None, init_weights=None, fn: str = "fit") -> None:
    L.seed_everything(0)
    model = LitLMScheduled(n_layers=n_layers)
    t = trainer(strategy("1F1B", init_weights=init_weights), max_steps=-1, max_epochs=3)
    try:
        getattr(t, fn)(model, ckpt_path=ckpt_path)
        message = "no error"
    except PipelineCheckpointError as err:
        message = str(err)
    save({"error": message}, out, f"error-{name}", t.global_rank)


def main() -> None:
    out = Path(sys.argv[1])
    last = ModelCheckpoint(dirpath=out / "1f1b", save_last=True, save_top_k=-1, save_on_train_epoch_end=True)
    resume(out, "1f1b-resumed", "1F1B", "last", callbacks=[last])
    resume(out, "interleaved-resumed", "Interleaved1F1B", str(out / "interleaved.ckpt"))
    # 4 stages on 2 ranks saved, 2 stages (one per rank) loaded.
    resume(out, "reshard-resumed", "1F1B", str(out / "interleaved.ckpt"))
    first_step(out, "init-plain", out / "pretrained.pt")
    first_step(out, "init-ckpt", out / "single.ckpt")
    first_step(out, "init-dir", out / "weights.ckpt")

    expect_error(out, "fewer-layers", n_layers=6, ckpt_path=str(out / "interleaved.ckpt"))
    expect_error(out, "more-layers", n_layers=10, ckpt_path=str(out / "interleaved.ckpt"))
    for corrupt in ("truncated", "no-manifest", "no-scheduler", "no-trainer-state"):
        expect_error(out, corrupt, ckpt_path=str(out / f"corrupt-{corrupt}.ckpt"))
    expect_error(out, "tmp-dir", ckpt_path=str(out / "corrupt-truncated.ckpt.tmp-0a1b"))
    expect_error(out, "weights-only", ckpt_path=str(out / "weights.ckpt"))
    expect_error(out, "single-file-fit", ckpt_path=str(out / "single.ckpt"))
    expect_error(out, "init-other-model", n_layers=6, init_weights=out / "pretrained.pt")
    expect_error(out, "init-missing", init_weights=out / "does-not-exist.pt")


if __name__ == "__main__":
    main()
