"""Manual optimization (``self.automatic_optimization = False``) under the pipeline (lightning_pipe/step/manual.py):
the step's optimizer calls are recorded while the schedule runs it and done once per batch after it. One process, two
stages per rank (so the schedule runs two stages and two microbatches); the 2-process run with Lightning's own
``ManualOptimBoringModel`` is in tests/test_project.py."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import ManualOptimBoringModel, RandomDataset
from torch import nn
from torch.utils.data import DataLoader

from lightning_pipe import PipelineParallelStrategy
from lightning_pipe.errors import PipelineUsageError
from lightning_pipe.parallel.grads import StageGradients
from lightning_pipe.step.manual import BACKWARD, STEP, ZERO_GRAD, agreed_ops, describe
from tests.models import quiet_trainer


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(4)])
        self.head = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


class Manual(L.LightningModule):
    """A manual-optimization step; ``every``: step (and clip, zero, schedule) every ``every``-th batch, accumulating
    gradients in between; ``auto``: the same training with automatic optimization."""

    def __init__(self, auto: bool = False, every: int = 1, clip: float | None = None) -> None:
        super().__init__()
        self.net = _Net()
        self.automatic_optimization = auto
        self.every, self.clip = every, clip
        self.losses: list[float] = []
        self.returned: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch), torch.ones(batch.shape[0], 2))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
        if self.automatic_optimization:
            return self.loss(batch)
        opt, sch = self.optimizers(), self.lr_schedulers()
        loss = self.loss(batch)
        self.manual_backward(loss)
        if (batch_idx + 1) % self.every == 0:
            if self.clip:
                self.clip_gradients(opt, self.clip, "norm")
            opt.step()
            opt.zero_grad()
            sch.step()
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.returned.append(outputs)
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=4)


def _pipeline() -> PipelineParallelStrategy:
    return PipelineParallelStrategy(microbatches=2, stages_per_rank=2, schedule="Interleaved1F1B")


def _fit(model: L.LightningModule, strategy: Any, max_steps: int = 4) -> tuple[L.LightningModule, L.Trainer]:
    trainer = quiet_trainer(max_steps=max_steps, devices=1, strategy=strategy)
    trainer.fit(model)
    return model, trainer


def _seeded(**kwargs: Any) -> Manual:
    L.seed_everything(0)
    return Manual(**kwargs)


def _states_equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the pipeline's op sequence, for the bitwise comparisons
    yield
    torch.set_num_threads(threads)


def test_a_manual_step_trains_bitwise_as_the_same_step_under_automatic_optimization(one_thread):
    # zero_grad, manual_backward, step and a per-batch scheduler step, done once per batch after the schedule, are
    # what Lightning's automatic loop does around the same schedule: the same numbers, bit for bit.
    automatic, auto_trainer = _fit(_seeded(auto=True), _pipeline())
    manual, trainer = _fit(_seeded(), _pipeline())
    assert _states_equal(manual, automatic)
    assert manual.losses == automatic.losses and trainer.global_step == auto_trainer.global_step == 4
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)
    # what the step returned (its loss, as one device's manual loop hands it to on_train_batch_end) and what it logged
    assert set(manual.returned[0]) == {"loss"} and float(trainer.callback_metrics["train_loss"]) == manual.losses[-1]


def test_accumulating_over_batches_clipping_and_a_scheduler_equal_one_device(one_thread):
    # backward every batch, clip, step, zero_grad and the scheduler every 2nd: one device's numbers up to float order
    one_device, reference = _fit(_seeded(every=2, clip=0.05), "auto", max_steps=3)
    piped, trainer = _fit(_seeded(every=2, clip=0.05), _pipeline(), max_steps=3)
    assert trainer.global_step == reference.global_step == 3 and len(piped.losses) == 6
    assert piped.losses == pytest.approx(one_device.losses, rel=1e-6)
    for key, value in one_device.state_dict().items():
        torch.testing.assert_close(piped.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    assert trainer.optimizers[0].param_groups[0]["lr"] == reference.optimizers[0].param_groups[0]["lr"] == 0.0125


def test_gradients_are_synchronised_once_per_optimizer_step_before_the_clip_reads_them(monkeypatch):
    # Replicas' gradients are averaged (and tied copies summed) once before a clip or step reads them: summing tied
    # copies again after each of a step's accumulated backwards would count the earlier batches twice.
    model, calls = _seeded(every=2, clip=0.05), []
    synchronize = StageGradients.synchronize

    def counted(self, optimizer):
        progress = model.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        stepping = progress.total.ready - progress.total.completed  # 1 inside the optimizer step, 0 before it
        calls.append((model.trainer.global_step, stepping))
        synchronize(self, optimizer)

    monkeypatch.setattr(StageGradients, "synchronize", counted)
    _fit(model, _pipeline(), max_steps=3)
    assert calls == [(0, 0), (1, 0), (2, 0)]  # 6 backwards, 3 clips and 3 steps: once each step, before its clip


def test_lightnings_manual_optimization_demo_runs_as_on_one_device():
    L.seed_everything(0)
    expected, _ = _fit(ManualOptimBoringModel(), "auto", max_steps=3)
    L.seed_everything(0)
    got, trainer = _fit(ManualOptimBoringModel(), PipelineParallelStrategy(), max_steps=3)
    assert trainer.global_step == 3
    for key, value in expected.state_dict().items():
        torch.testing.assert_close(got.state_dict()[key], value, rtol=1e-6, atol=1e-7)


class _Refused(Manual):
    """One way of writing a manual step that the pipeline cannot run exactly (``how``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
        opt, sch = self.optimizers(), self.lr_schedulers()
        if self.how == "step before forward":
            opt.step()
        loss = self.loss(batch)
        if self.how == "two backwards":
            self.manual_backward(loss / 2)
            self.manual_backward(loss / 2)
        elif self.how == "no backward":
            pass
        elif self.how == "backward options":
            self.manual_backward(loss, retain_graph=True)
        elif self.how == "vector loss":
            self.manual_backward(loss.reshape(1).expand(2))
        else:
            self.manual_backward(loss)
        if self.how == "closure":
            opt.step(closure=lambda: loss)
        elif self.how == "scheduler value":
            sch.step(loss)
        elif self.how == "per run":  # a count of the step's runs: each microbatch's run sees another
            self.runs = getattr(self, "runs", 0) + 1
            if self.runs % 2:
                opt.step()
        elif self.how == "foreign optimizer":
            self.clip_gradients(torch.optim.SGD(self.parameters(), lr=0.1), 1.0, "norm")
        else:
            opt.step()
        return loss


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("two backwards", r"called `self.manual_backward` 2 times.*exactly once.*\(a GAN\) needs `strategy='ddp'`"),
        ("no backward", r"called `self.manual_backward` 0 times \(its calls: optimizer.step\(\)\)"),
        ("backward options", r"`self.manual_backward\(loss, retain_graph=...\)`.*Call `self.manual_backward\(loss\)`"),
        ("vector loss", r"`self.manual_backward` got \(2,\); .* takes a scalar loss tensor"),
        ("closure", r"`optimizer.step\(closure\)`.*re-runs the forward.*without a closure"),
        ("step before forward", r"`optimizer.step\(\)` before the pipelined network's forward.*after the forward"),
        ("scheduler value", r"`scheduler.step\(Tensor\)`.*one microbatch's.*`on_train_batch_end`"),
        ("per run", r"different optimizer calls for the microbatches of one batch \(microbatch 0: "),
        ("foreign optimizer", r"`self.clip_gradients` got an optimizer \(SGD\).*`self.optimizers\(\)`"),
    ],
)
def test_a_manual_step_the_pipeline_cannot_run_exactly_is_refused_by_name(how, message):
    with pytest.raises(PipelineUsageError, match=message):
        _fit(_Refused(how), _pipeline(), max_steps=2)


def test_recorded_calls_read_as_the_user_wrote_them_and_must_agree_over_microbatches():
    ops = ((ZERO_GRAD, 0, {"set_to_none": True}), (BACKWARD, 0, {}), (STEP, 0, {}))
    assert describe(ops) == "optimizer.zero_grad(), self.manual_backward(loss), optimizer.step()"
    assert agreed_ops("training_step", [ops, ops]) == ops
    with pytest.raises(PipelineUsageError, match=r"microbatch 1: self.manual_backward\(loss\)\)"):
        agreed_ops("training_step", [ops, ops[1:2]])
