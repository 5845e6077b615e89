"""A pipeline run that a rank may kill (SIGKILL) in its first attempt, restarted by its launcher and resumed by the
strategy from the newest complete checkpoint; or the same run uninterrupted, as the reference.

Usage: restart.py OUT CONFIG_JSON. CONFIG: ``devices`` (2: a 2-stage pipeline; 4: 2 stages x 2 data-parallel replicas),
``async`` (asynchronous checkpoints), ``max_restarts`` (for Lightning's launcher; torchrun's comes from
``--max-restarts``), ``kill`` (absent: no fault): ``{"rank", "step", "where"}`` with ``where`` ``"step"`` (inside the
rank's stage forward of training step ``step``), ``"validation"`` (inside its stage forward in the validation after
training step ``step``), ``"serialise"`` / ``"exchange"`` (in the snapshot of step ``step``: while it serialises its
checkpoint dict to host memory, or when it starts exchanging copies with its buddy) or ``"write"`` (inside the writing
of its shard of the first checkpoint saved at or after step ``step``: for an asynchronous save, in the writing thread
while training goes on); ``kills``: several such faults, each with the ``generation`` (of a run recovered in place) it
applies in; ``snapshot_every`` (recovery in place: the supervisor replaces the killed rank, the others keep their
processes), ``spares``, ``await_spare`` (a ``step`` kill in generation ``g`` waits until spare ``g`` reached ``fit``,
before the previous step's end is recorded), ``disk`` (false: no ``ModelCheckpoint``, so nothing can be read from disk).

The model has dropout in every block, the training loader shuffles (48 samples: 6 batches an epoch on 2 processes, so
checkpoints every 5 steps fall mid-epoch and on epoch boundaries), validation runs every 5 steps, checkpoints are saved
every 5 steps (all kept) and as ``last.ckpt``. Every attempt appends ``{"attempt", "step", "loss"}`` per step to
``losses.rank<R>.jsonl`` and ``{"generation", "step", "val_loss"}`` per validation to ``val.rank<R>.jsonl``; the last
attempt saves its stages' final weights as ``final.rank<R>.pt``; an attempt that resumed writes ``resumed.rank<R>.json``
(from which step, when its first step ended; every resume is also appended to ``resumed.rank<R>.jsonl``, every kill to
``injected.jsonl``); a rank that reads a checkpoint file (torch.distributed checkpoint's reader) appends it to
``reads.rank<R>.txt``.
"""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

import lightning_pipe
from tests.models import VOCAB, LitLM, token_dataset

STEPS = 24
EVERY = 5


def attempt() -> int:
    for name in ("TORCHELASTIC_RESTART_COUNT", "LIGHTNING_PIPE_RESTART_COUNT"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def generation() -> int:
    """The generation of a run recovered in place (0 before any recovery)."""
    return int(os.environ.get("LIGHTNING_PIPE_GENERATION", "0"))


def rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def kill_here(cfg: dict, where: str, step: int) -> bool:
    """Whether this rank is to be killed at ``where`` of step ``step`` in this attempt and generation."""
    kills = cfg.get("kills", [cfg["kill"]] if cfg.get("kill") else [])
    return attempt() == 0 and any(
        k["where"] == where and k["rank"] == rank() and k["step"] == step and k.get("generation", 0) == generation()
        for k in kills
    )


class DropoutLM(LitLM):
    """LitLM with dropout after every block (a random stream on every stage), shuffled data, validation."""

    def __init__(self, replicas: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.replicas = replicas
        self.model.layers = nn.ModuleList(nn.Sequential(block, nn.Dropout(0.1)) for block in self.model.layers)

    def train_dataloader(self):
        return DataLoader(token_dataset(48), batch_size=8, shuffle=True)

    def val_dataloader(self):
        # 2 batches per replica (DistributedSampler), so that a `validation` kill (at batch 1) comes mid-validation
        return DataLoader(token_dataset(16 * self.replicas, seed=1), batch_size=8)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1)))


class Record(L.Callback):
    def __init__(self, out: Path, cfg: dict) -> None:
        self.out, self.cfg, self.first = out, cfg, True

    def on_fit_start(self, trainer, pl_module):
        self.first = True  # a `fit` run again in place after a lost rank starts again here
        (self.out / f"fit_start.rank{trainer.global_rank}.{time.time()}").write_text(str(os.getpid()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if kill_here(self.cfg, "step", trainer.global_step + 1):
            block = next(m for m in pl_module.model.layers if m is not None)
            block.register_forward_hook(lambda *_: die(self.out, trainer.global_step))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 1 and not trainer.sanity_checking and kill_here(self.cfg, "validation", trainer.global_step):
            block = next(m for m in pl_module.model.layers if m is not None)
            block.register_forward_hook(lambda *_: die(self.out, trainer.global_step))

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        line = {
            "generation": generation(),
            "step": trainer.global_step,
            "val_loss": float(trainer.callback_metrics["val_loss"]).hex(),
        }
        with open(self.out / f"val.rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.cfg.get("await_spare") and kill_here(self.cfg, "step", trainer.global_step + 1):
            await_spare(self.out, generation())  # before this step's end is recorded: the wait is not measured
        loss = float(outputs["loss"] if isinstance(outputs, dict) else outputs)
        line = {"attempt": attempt(), "generation": generation(), "step": trainer.global_step, "loss": loss.hex()}
        line["time"] = time.time()
        with open(self.out / f"losses.rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        if self.first and (attempt() > 0 or generation() > 0):
            resumed = {
                "attempt": attempt(),
                "generation": generation(),
                "from_step": trainer.global_step - 1,
                "first_step_end": time.time(),
            }
            (self.out / f"resumed.rank{trainer.global_rank}.json").write_text(json.dumps(resumed))
            with open(self.out / f"resumed.rank{trainer.global_rank}.jsonl", "a") as f:
                f.write(json.dumps(resumed) + "\n")
        self.first = False


def await_spare(out: Path, index: int) -> None:
    """Wait until spare ``index`` reached ``fit`` (the kill it takes then measures recovery, not the spare's start)."""
    deadline = time.monotonic() + 300
    while not (out / f"spare.ready.{index}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def die(out: Path, completed: int) -> None:
    """SIGKILL this process; ``completed``: the training steps done before it."""
    info = {"rank": rank(), "completed": completed, "time": time.time(), "pid": os.getpid(), "generation": generation()}
    (out / "injected.json").write_text(json.dumps(info))
    with open(out / "injected.jsonl", "a") as f:
        f.write(json.dumps(info) + "\n")
    os.kill(os.getpid(), signal.SIGKILL)


def arm_write_kill(out: Path, cfg: dict, trainer_step) -> None:
    """SIGKILL this rank inside the writing of its shard of the first checkpoint saved at or after the given step."""
    kills = cfg.get("kills", [cfg["kill"]] if cfg.get("kill") else [])
    writes = [k for k in kills if k["where"] == "write"]
    if attempt() > 0 or not writes:
        return
    write_data = dcp.FileSystemWriter.write_data

    def write_then_die(writer, plan, planner):
        # rank() now: a spare learns its rank when it takes a place
        if any(
            trainer_step() >= k["step"] and (k["rank"], k.get("generation", 0)) == (rank(), generation())
            for k in writes
        ):
            die(out, trainer_step())
        return write_data(writer, plan, planner)

    dcp.FileSystemWriter.write_data = write_then_die


def arm_snapshot_kills(out: Path, cfg: dict, trainer_step) -> None:
    """SIGKILL this rank in a snapshot: while it serialises its checkpoint dict, or as it starts the exchange with its
    buddy (its own copy is kept, the buddy's is not)."""
    from lightning_pipe.checkpoint import snapshot

    dump, exchange = snapshot.pl_compat.dump_checkpoint, snapshot.collectives.exchange_bytes

    def dump_then_die(trainer):
        checkpoint = dump(trainer)
        if kill_here(cfg, "serialise", trainer_step()):
            die(out, trainer_step())
        return checkpoint

    def die_then_exchange(data, to, source, *group):
        # The exchange runs in the snapshot's thread (named after its step) while training goes on.
        name = threading.current_thread().name
        step = int(name.rsplit(" ", 1)[1]) if name.startswith("lightning-pipe snapshot ") else trainer_step()
        if kill_here(cfg, "exchange", step):
            die(out, trainer_step())
        return exchange(data, to, source, *group)

    snapshot.pl_compat.dump_checkpoint = dump_then_die
    snapshot.collectives.exchange_bytes = die_then_exchange


def record_reads(out: Path) -> None:
    """Append every checkpoint file this rank reads (torch.distributed.checkpoint's reader) to ``reads.rank<R>.txt``."""
    read_data = dcp.FileSystemReader.read_data

    def record_then_read(reader, plan, planner):
        with open(out / f"reads.rank{rank()}.txt", "a") as f:
            f.write(f"{reader.path}\n")
        return read_data(reader, plan, planner)

    dcp.FileSystemReader.read_data = record_then_read


def main() -> None:
    out, cfg = Path(sys.argv[1]), json.loads(sys.argv[2])
    if generation() == 0:
        (out / f"pid.rank{rank()}.attempt{attempt()}").write_text(str(os.getpid()))
    else:
        (out / f"pid.rank{rank()}.generation{generation()}").write_text(str(os.getpid()))
    L.seed_everything(0)
    model = DropoutLM(replicas=cfg["devices"] // 2, n_layers=4)
    strategy = lightning_pipe.PipelineParallelStrategy(
        pipeline_size=2,
        async_checkpoint=cfg.get("async", False),
        max_restarts=cfg.get("max_restarts", 0),
        snapshot_every=cfg.get("snapshot_every", 0),
        spares=cfg.get("spares", 0),
    )
    checkpoints = [ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=EVERY, save_top_k=-1, save_last=True)]
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=cfg["devices"],
        max_steps=STEPS,
        val_check_interval=EVERY,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        callbacks=[*(checkpoints if cfg.get("disk", True) else []), Record(out, cfg)],
        enable_checkpointing=cfg.get("disk", True),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if os.environ.get("LIGHTNING_PIPE_SPARE"):
        (out / f"spare.ready.{os.environ['LIGHTNING_PIPE_SPARE']}").touch()
    arm_write_kill(out, cfg, lambda: trainer.global_step)
    arm_snapshot_kills(out, cfg, lambda: trainer.global_step)
    record_reads(out)
    trainer.fit(model)
    state = {k: v for k, v in model.state_dict().items()}
    torch.save(state, out / f"final.rank{trainer.global_rank}.pt")
    (out / f"pid_end.rank{trainer.global_rank}").write_text(str(os.getpid()))
    snapshots = strategy._snapshots  # measured by benchmarks/recovery.py
    if snapshots is not None:
        stats = {
            "bytes": snapshots.nbytes(),
            "last_bytes": snapshots.last_bytes,
            "last_seconds": snapshots.last_seconds,
        }
        (out / f"snapshot.rank{trainer.global_rank}.json").write_text(json.dumps(stats))


if __name__ == "__main__":
    main()
