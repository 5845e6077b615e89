"""A training step reads nothing back to the host that plain Lightning does not (issue 52, item 1).

On a GPU each read of a tensor's value on the host (``item``, ``tolist``, ``bool``, ``float``, a copy to the CPU)
waits for the device's queue to drain. On the CPU the same calls are counted with a ``TorchFunctionMode``: a step that
makes none on the CPU makes none on a GPU from these calls. (Copies *to* a GPU, which also wait there, are invisible
on the CPU: the CUDA test below catches them.)
"""

from __future__ import annotations

import functools
import traceback
from collections import Counter
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from lightning_pipe import PipelineParallelStrategy
from lightning_pipe.step.engine import StepEngine
from lightning_pipe.step.interception import LoggedValue
from lightning_pipe.step.merging import merge_device, merge_microbatch_logs, merge_outputs
from tests.models import VOCAB, LitLM, LitLMWithMetric, quiet_trainer

#: what reads a tensor's value on the host (and ``to`` where it copies to the CPU: see :class:`HostReads`)
_READS = {
    torch.Tensor.cpu,
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
}


def _to_cpu(args: tuple, kwargs: dict) -> bool:
    named = [kwargs.get("device"), *(a for a in args[1:] if isinstance(a, (str, torch.device)))]
    return any(d is not None and torch.device(d).type == "cpu" for d in named)


class HostReads(TorchFunctionMode):
    """Counts host reads of tensors while :attr:`counting`, by call site. ``cpu()`` counts; ``to`` counts when it names
    the CPU and copies (on a GPU run, a copy to the host), not when it returns its input (the data already there: on
    the CPU, Lightning's move of the batch to the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = False
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        copied_to_cpu = func is torch.Tensor.to and out is not args[0] and _to_cpu(args, kwargs)
        if self.counting and (func in _READS or copied_to_cpu):
            frames = [f for f in traceback.extract_stack()[:-1] if "torch/overrides" not in f.filename][-2:]
            self.sites[f"{func.__name__} at " + " <- ".join(f"{f.filename}:{f.lineno}" for f in reversed(frames))] += 1
        return out


class PerStep(L.Callback):
    """The host reads of each training step, from its start (the batch already on the device) to its end (the
    optimizer step done; callbacks' ``on_train_batch_end`` runs before the LightningModule's and the loggers')."""

    def __init__(self, reads: HostReads) -> None:
        self.reads = reads
        self.steps: list[Counter[str]] = []

    def on_train_batch_start(self, *args: Any) -> None:
        # The mode is on only in the step (on everywhere, it slows the whole fit down).
        self.reads.sites, self.reads.counting = Counter(), True
        self.reads.__enter__()

    def on_train_batch_end(self, *args: Any) -> None:
        self.reads.__exit__(None, None, None)
        self.reads.counting = False
        self.steps.append(self.reads.sites)


class _Logging(LitLM):
    """Logs the ways a step can: a loss on the progress bar, a sum, a value weighted by ``batch_size=``, a number
    (unless ``number=False``: logging a Python number copies it to the device, on one device too)."""

    def __init__(self, number: bool = True) -> None:
        super().__init__()
        self.number = number

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        self.log("tokens", (y >= 0).sum().float(), reduce_fx="sum")
        self.log("top", logits.max(), batch_size=x.shape[0])
        if self.number:
            self.log("lr", 0.05)
        return loss


def _reads_per_step(model: L.LightningModule, strategy: Any, steps: int = 3) -> list[Counter[str]]:
    reads = HostReads()
    per_step = PerStep(reads)
    L.seed_everything(0)
    quiet_trainer(devices=1, max_steps=steps, strategy=strategy, callbacks=[per_step]).fit(model)
    assert len(per_step.steps) == steps
    return per_step.steps


def test_microbatch_logs_merge_where_they_are():
    """On the meta device, where a copy to the host raises: the merged values and the loss stay on the device."""
    meta = [torch.ones((), device="meta") for _ in range(4)]
    logs = [[LoggedValue("loss", v), LoggedValue("n", v, {"reduce_fx": "sum"}), LoggedValue("lr", 0.1)] for v in meta]
    merged = merge_microbatch_logs(logs, weights=[2.0, 2.0, 1.0, 3.0])
    assert [(e.name, e.value.device.type, e.value.dtype) for e in merged] == [
        ("loss", "meta", torch.float32),
        ("n", "meta", torch.float32),
        ("lr", "cpu", torch.float32),  # Python numbers: merged on the CPU, where they are
    ]
    loss = merge_outputs(meta, [2.0, 2.0, 1.0, 3.0], "training_step")
    assert loss.device.type == "meta" and loss.dtype == torch.float32


def test_merging_falls_back_to_the_cpu_where_the_device_has_no_float64():
    class OnMps:
        device = torch.device("mps")

    assert merge_device([OnMps()]) == torch.device("cpu")  # type: ignore[list-item]
    assert merge_device([torch.ones(()), torch.ones((), device="meta")]) == torch.device("meta")


@functools.cache
def _plain(model: type) -> tuple[int, ...]:
    """Plain Lightning's host reads in each step of ``model``, counted the same way (the reference)."""
    return tuple(sum(step.values()) for step in _reads_per_step(model(), "auto"))


def test_the_counter_sees_reads_and_copies_to_the_host():
    reads = HostReads()
    t = torch.ones(3)
    with reads:
        reads.counting = True
        t.sum().item(), bool(t[0]), float(t[1]), t.tolist(), t.to("cpu", torch.float64), t.cpu(), t.to("cpu")
        t.to(torch.float64), t * 2  # no read: a conversion on the device, arithmetic
    counted = Counter(site.split(" at ")[0] for site in reads.sites.elements())
    assert counted == {"item": 1, "__bool__": 1, "__float__": 1, "tolist": 1, "to": 1, "cpu": 1}


@pytest.mark.parametrize(
    "model, settings",
    [
        (_Logging, dict(microbatches=4, stages_per_rank=2, schedule="Interleaved1F1B")),
        (LitLMWithMetric, dict(microbatches=4, schedule="GPipe")),
    ],
    ids=["logs-Interleaved1F1B-2-stages", "metric-GPipe-1-stage"],
)
def test_a_training_step_reads_the_host_no_more_than_plain_lightning(model, settings):
    plain = _plain(model)
    piped = _reads_per_step(model(), PipelineParallelStrategy(**settings))
    # The first step's extra reads are torch's one-time shape inference (its P2P warm-up vote), not a step's.
    for step in range(1, len(piped)):
        reads = sum(piped[step].values())
        assert reads <= 1 and reads <= plain[step], (step, dict(piped[step]), plain[step])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: counts the device synchronisations themselves")
def test_a_training_step_on_cuda_never_waits_for_the_device(monkeypatch):
    """torch raises on any synchronising call (a read to the host, a blocking copy to the device) inside a step's
    schedule, settle and replay, after the first step (torch's shape inference)."""
    train = StepEngine.train
    calls = []

    def strict(self: StepEngine, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            return train(self, *args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return train(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(StepEngine, "train", strict)
    L.seed_everything(0)
    strategy = PipelineParallelStrategy(microbatches=4, stages_per_rank=2, schedule="Interleaved1F1B")
    quiet_trainer(accelerator="cuda", devices=1, max_steps=4, strategy=strategy).fit(_Logging(number=False))
    assert len(calls) == 4
