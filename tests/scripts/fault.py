"""One rank fails on purpose (SIGKILL or an exception) in one phase of a pipeline run; or a run resumes from the last
checkpoint such a run left.

Usage: fault.py OUT CONFIG_JSON, CONFIG = {"phase", "action", "rank", "devices"} or {"resume": true, "devices"}.
- phase: ``startup`` (before the process group exists), ``pg`` (inside ``init_process_group``, after the rendezvous,
  while the others create the group), ``step`` (inside the rank's stage forward in training step 4), ``validation``
  (inside its stage forward in the second validation run), ``save`` (after writing its shard of the second checkpoint,
  before the save completes), ``teardown`` (inside the strategy's teardown after training).
- action: ``kill`` (SIGKILL to itself) or ``raise`` (``InjectedFailure``).

Every rank writes ``pid.rank<R>`` at start; the failing rank writes ``injected.json`` (with the time) right before
failing. Training: 6 steps of 8 samples, validation and ``last.ckpt`` every 2 steps, timeout 300 s (the run must end
long before it matters).
"""

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_pipe
from lightning_pipe.compat import lightning as pl_compat
from tests.models import VOCAB, LitLM, token_dataset

TIMEOUT = timedelta(seconds=300)


class InjectedFailure(RuntimeError):
    pass


class LitLMVal(LitLM):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))
        self.log("val_loss", loss)
        return loss

    def val_dataloader(self):
        return DataLoader(token_dataset(16, seed=1), batch_size=8)


def rank() -> int:
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


class Fault:
    def __init__(self, out: Path, cfg: dict) -> None:
        self.out, self.phase, self.action, self.rank = out, cfg.get("phase"), cfg.get("action"), cfg.get("rank")

    def mine(self, phase: str) -> bool:
        return self.phase == phase and rank() == self.rank

    def fail(self) -> None:
        info = {"rank": rank(), "phase": self.phase, "action": self.action, "time": time.time(), "pid": os.getpid()}
        (self.out / "injected.json").write_text(json.dumps(info))
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFailure(f"injected failure on rank {rank()} ({self.phase})")

    def install(self) -> None:
        """Patch the places where the start-up, save and teardown faults fire."""
        fault = self
        init = pl_compat.init_dist_connection

        def init_dist_connection(*args, **kwargs):
            if fault.mine("startup"):
                fault.fail()
            return init(*args, **kwargs)

        pl_compat.init_dist_connection = init_dist_connection
        rendezvous = dist.distributed_c10d.rendezvous

        def rendezvous_then_fail(*args, **kwargs):
            for result in rendezvous(*args, **kwargs):
                if fault.mine("pg"):
                    fault.fail()
                yield result

        dist.distributed_c10d.rendezvous = rendezvous_then_fail
        write_data, saves = dcp.FileSystemWriter.write_data, []

        def write_data_then_fail(writer, plan, planner):
            future = write_data(writer, plan, planner)
            saves.append(1)
            if fault.mine("save") and len(saves) == 2:
                future.wait()  # this rank's shard is on disk; the save is not complete
                fault.fail()
            return future

        dcp.FileSystemWriter.write_data = write_data_then_fail

    def install_teardown(self, trainer: L.Trainer) -> None:
        """Fail inside the strategy's teardown after training (in the cluster environment's teardown it calls)."""
        fault, environment = self, trainer.strategy.cluster_environment
        teardown = environment.teardown

        def teardown_then_fail():
            teardown()
            if fault.mine("teardown"):
                fault.phase = None  # once
                fault.fail()

        environment.teardown = teardown_then_fail


class ForwardFault(L.Callback):
    """Arms a forward hook on one of this rank's own blocks, so the fault fires inside the schedule."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self.validations = 0

    def _arm(self, pl_module) -> None:
        block = next(m for m in pl_module.model.layers if m is not None)
        block.register_forward_hook(lambda *_: self.fault.fail())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.fault.mine("step") and batch_idx == 3:
            self._arm(pl_module)

    def on_validation_start(self, trainer, pl_module):
        self.validations += 1

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.fault.mine("validation") and self.validations == 2 and batch_idx == 1:
            self._arm(pl_module)


def main() -> None:
    out, cfg = Path(sys.argv[1]), json.loads(sys.argv[2])
    (out / f"pid.rank{rank()}").write_text(str(os.getpid()))
    fault = Fault(out, cfg)
    fault.install()
    L.seed_everything(0)
    model = LitLMVal(n_layers=4)
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=2)
    trainer = L.Trainer(
        strategy=lightning_pipe.PipelineParallelStrategy(timeout=TIMEOUT),
        accelerator="cpu",
        devices=cfg["devices"],
        max_steps=8 if cfg.get("resume") else 6,
        val_check_interval=2,
        num_sanity_val_steps=0,
        logger=False,
        callbacks=[checkpoint, ForwardFault(fault)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    fault.install_teardown(trainer)
    trainer.fit(model, ckpt_path=str(out / "ckpt" / "last.ckpt") if cfg.get("resume") else None)
    done = {"global_step": trainer.global_step, "losses": model.step_losses}
    torch.save(done, out / f"done.rank{trainer.global_rank}")


if __name__ == "__main__":
    main()
