"""The same training through Lightning: ``PipelineParallelStrategy``, ``strategy="ddp"`` and one device; and
Lightning's loop driving the hand-written pipeline (:class:`HandModule`), Lightning's share of the strategy's cost.

The LightningModule is what a user writes for the network of :mod:`benchmarks.common`: call the network, compute
the MSE loss, optionally ``self.log`` it (``log=True``), return it. A callback stamps the clock where the hand loops
do: at the start of every batch, and once after the last.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch

from benchmarks.common import LR, Clock, ModelSpec, dataset, loader, loss_fn, make_network


class BenchModule(L.LightningModule):
    def __init__(self, spec: ModelSpec, batch: int, batches: int, log: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.spec, self.batch, self.batches, self.log_loss = spec, batch, batches, log
        self.net = make_network(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = loss_fn(self(x), y)
        if self.log_loss:
            self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = loss_fn(self(x), y)
        if self.log_loss:
            self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self) -> Any:
        return loader(dataset(self.spec, self.batches), self.batch)

    def val_dataloader(self) -> Any:
        return loader(dataset(self.spec, self.batches, seed=1), self.batch)


class HandModule(L.LightningModule):
    """Lightning's loop driving the hand-written pipeline (:class:`benchmarks.hand.HandPipeline`), under automatic
    optimization as a user could write it: ``training_step`` keeps the batch and returns a placeholder loss, the
    overridden ``backward`` runs the torch schedule on the batch (after Lightning's ``zero_grad``), and Lightning steps
    the hand loop's SGD. What a step costs here over the hand loop alone is Lightning's share of the strategy's fixed
    cost: its loop, hooks, data path and per-step collective, with nothing of the strategy."""

    def __init__(self, spec: ModelSpec, schedule: str, microbatches: int, batch: int, batches: int) -> None:
        super().__init__()
        self.spec, self.schedule, self.microbatches = spec, schedule, microbatches
        self.batch, self.batches = batch, batches
        self.pipeline: Any = None
        self._batch: Any = None

    def configure_model(self) -> None:
        from benchmarks.hand import HandPipeline

        trainer = self.trainer
        self.pipeline = HandPipeline(
            self.spec, self.schedule, self.microbatches, trainer.global_rank, trainer.world_size, self.device
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._batch = batch
        return torch.zeros((), device=self.device, requires_grad=True)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.pipeline.forward_backward(*self._batch)
        self._batch = None

    def configure_optimizers(self) -> Any:
        return self.pipeline.optimizer

    def train_dataloader(self) -> Any:
        return loader(dataset(self.spec, self.batches), self.batch)


def pipeline_strategy(case: dict[str, Any], **extra: Any) -> Any:
    """The strategy of a benchmark case: its ``schedule`` and ``microbatches`` (``extra``: more arguments)."""
    from lightning_pipe import PipelineParallelStrategy

    return PipelineParallelStrategy(schedule=case["schedule"], microbatches=case["microbatches"], **extra)


def unwrapped_ddp() -> Any:
    """Lightning's ``DDPStrategy`` (its launch, loop and per-step collective) without the ``DistributedDataParallel``
    wrapper: the hand pipeline's stages differ from rank to rank and have no gradients to average."""
    from lightning.pytorch.strategies import DDPStrategy

    class UnwrappedDDP(DDPStrategy):
        def configure_ddp(self) -> None:
            pass

    return UnwrappedDDP()


class StepClock(L.Callback):
    """Stamps the clock at the start of every training (or validation) batch and after the last."""

    def __init__(self) -> None:
        self.clock: Clock | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.clock = Clock(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.clock.tick()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.clock.tick()

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, *args: Any) -> None:
        if not trainer.sanity_checking:
            self.clock.tick()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.clock.tick()


def trainer(
    strategy: Any, devices: int, steps: int, callbacks: list[Any], val_batches: int = 0, accelerator: str = "auto"
) -> L.Trainer:
    """A benchmark Trainer: on CUDA where torch sees it (``accelerator="auto"``), else the CPU or ``accelerator``."""
    return L.Trainer(
        strategy=strategy,
        accelerator=("cuda" if torch.cuda.is_available() else "cpu") if accelerator == "auto" else accelerator,
        devices=devices,
        max_steps=steps,
        limit_val_batches=val_batches,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def fit(
    spec: ModelSpec, strategy: Any, devices: int, batch: int, steps: int, log: bool = False, extra: list | None = None
) -> Clock:
    clock = StepClock()
    model = BenchModule(spec, batch, steps, log=log)
    trainer(strategy, devices, steps, [clock, *(extra or [])]).fit(model)
    return clock.clock


def fit_hand(
    spec: ModelSpec, schedule: str, microbatches: int, devices: int, steps: int, extra: list | None = None
) -> Clock:
    """Lightning's loop driving the hand-written pipeline (:class:`HandModule`) for ``steps`` steps."""
    clock = StepClock()
    model = HandModule(spec, schedule, microbatches, spec.batch, steps)
    trainer(unwrapped_ddp(), devices, steps, [clock, *(extra or [])]).fit(model)
    return clock.clock


def validate(spec: ModelSpec, strategy: Any, devices: int, batch: int, steps: int) -> Clock:
    clock = StepClock()
    model = BenchModule(spec, batch, steps)
    trainer(strategy, devices, steps, [clock], val_batches=steps).validate(model, verbose=False)
    return clock.clock
