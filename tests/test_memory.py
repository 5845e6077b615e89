"""Memory measurement: model state, saved-for-backward bytes, peak during a block of code."""

from __future__ import annotations

import warnings

import lightning.pytorch as L
import pytest
import torch
from torch import nn

from lightning_pipe.measure.memory import (
    MemoryReport,
    PeakMemory,
    SavedBytesRecorder,
    SavedTensorBytes,
    format_bytes,
    saved_bytes,
    state_bytes,
)
from lightning_pipe.models.units import find_layout
from lightning_pipe.split.initialization import initialize
from lightning_pipe.split.partition import stage_units
from lightning_pipe.split.surgery import prune
from tests.gpt2 import GPT2

KIB = 1024


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * KIB) == "3.00 KiB"
    assert format_bytes(1.5 * 2**30) == "1.50 GiB"


def test_state_bytes_counts_parameters_gradients_and_adam_state():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 5))  # 110 + 55 floats
    optimizer = torch.optim.Adam(model.parameters())
    empty = state_bytes(model, [optimizer])
    assert (empty.parameters, empty.gradients, empty.optimizer_state) == (165 * 4, 0, 0)
    model(torch.randn(2, 10)).sum().backward()
    optimizer.step()
    after = state_bytes(model, [optimizer])
    # Adam: exp_avg and exp_avg_sq per parameter, plus a 4-byte `step` per parameter tensor.
    assert (after.gradients, after.optimizer_state) == (165 * 4, 2 * 165 * 4 + 4 * 4)
    assert after.total == after.parameters + after.gradients + after.optimizer_state
    line = after.report(rank=1, stages=[1, 3])
    assert line.startswith("rank 1 stages [1, 3]: parameters 660 B, gradients 660 B, optimizer state")


def test_tied_parameters_are_counted_once():
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    assert state_bytes(model).parameters == 8 * 4 * 4


def test_saved_bytes_of_a_linear_is_its_input():
    layer = nn.Linear(256, 256, bias=False)
    x = torch.randn(8, 256, requires_grad=True)
    assert saved_bytes(layer, (x,)) == 8 * 256 * 4  # the weight is excluded, the input is saved


def test_saved_bytes_counts_each_storage_once():
    x = torch.randn(64, 64, requires_grad=True)
    with SavedTensorBytes() as meter:
        (x * x).sum()  # saves x twice
    assert meter.bytes == 64 * 64 * 4


def test_fake_tensors_count_once_per_storage_without_asking_their_address():
    # The dataflow frontend's stand-ins run under fake tensors; a fake storage's data_ptr() warns (deprecated).
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(64, 64, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with SavedTensorBytes() as meter:
                (x * x[:32].repeat(2, 1)).sum()  # saves x and a copy: a view of x counts with x
    assert meter.bytes == 2 * 64 * 64 * 4


def test_recorder_records_the_first_grad_forward_only():
    model = GPT2(n_layer=2)
    recorder = SavedBytesRecorder(model)
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        model(x)
    assert recorder.bytes is None
    model(x)
    expected = saved_bytes(model, (x,))
    assert recorder.bytes == expected and expected > 0
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_peak_memory_on_cpu_counts_temporaries():
    with PeakMemory("cpu") as peak:
        a = torch.empty(256, KIB)  # 1 MiB
        b = torch.empty(512, KIB)  # 2 MiB
        del a, b
        c = torch.empty(256, KIB)
        del c
    assert peak.bytes == 3 * 2**20


def test_peak_memory_ignores_tensors_from_before():
    before = torch.ones(1024, KIB)
    with PeakMemory("cpu") as peak:
        view = before[:10]
        view.add_(1)
    assert peak.bytes == 0


def test_meta_construction_allocates_only_the_own_stage():
    def build() -> GPT2:
        with torch.device("meta"):
            return GPT2(vocab=512, block_size=32, n_layer=4, n_embd=128)

    full = sum(p.numel() * 4 for p in build().parameters()) + sum(b.numel() * 4 for b in build().buffers())
    layout = find_layout(build())
    for counts in ([2, 2], [1, 1, 1, 1]):
        for units in stage_units(layout, counts):
            with PeakMemory("cpu") as peak:
                model = build()
                prune(model, units, layout.units)
                initialize(model, torch.device("cpu"), seed=0, units=layout.units)
            own = state_bytes(model).parameters
            # Initialisation allocates small temporaries (markers' checks); never another stage's parameters.
            assert own <= peak.bytes <= own + max(own // 4, 64 * KIB), (counts, units)
            assert peak.bytes < own + min(own, full - own)


def test_memory_report_lines():
    state = state_bytes(nn.Linear(4, 4))
    report = MemoryReport(
        rank=0, stages=(0, 2), state=state, saved_per_microbatch={2: 2048, 0: 1024}, construction_peak=4096
    )
    lines = report.lines()
    assert lines[0].startswith("rank 0 stages [0, 2]: parameters 80 B")
    assert lines[1:] == [
        "rank 0 stage 0: 1.00 KiB saved for backward per microbatch",
        "rank 0 stage 2: 2.00 KiB saved for backward per microbatch",
        "rank 0: peak 4.00 KiB allocated during construction",
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_memory_on_cuda():
    with PeakMemory("cuda") as peak:
        a = torch.empty(2**20, device="cuda")
        del a
    assert peak.bytes == 4 * 2**20


@pytest.mark.parametrize("k", [2, 4])
def test_each_stage_holds_a_kth_of_parameters_and_adam_state(k):
    from lightning_pipe.split.balance import params_balance

    def trained_state(model: nn.Module) -> int:
        optimizer = torch.optim.AdamW(model.parameters())
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        state = state_bytes(model, [optimizer])
        return state.parameters + state.optimizer_state

    def build() -> GPT2:
        with torch.device("meta"):
            return GPT2(vocab=64, n_layer=8, n_embd=32)

    whole = build()
    layout = find_layout(whole)
    initialize(whole, torch.device("cpu"), seed=0)
    single = trained_state(whole)
    for units in stage_units(layout, params_balance(whole, layout, k)):
        stage = build()
        prune(stage, units, layout.units)
        initialize(stage, torch.device("cpu"), seed=0)
        assert trained_state(stage) <= single / k * 1.1, units


def test_measuring_saved_bytes_keeps_no_graph_alive():
    """ReLU saves its own output: had the pack hook kept the output's Python object, the graph would hold it and it
    the graph, a cycle through C++ that Python never frees (it leaked a microbatch's graph, batch included, per
    Trainer)."""
    import gc
    import weakref

    from lightning_pipe.measure.memory import SavedTensorBytes

    layer = torch.nn.Linear(4, 4)
    with SavedTensorBytes(exclude=list(layer.parameters())) as meter:
        out = torch.relu(layer(torch.randn(2, 4)))
    gone = weakref.ref(out)
    del out  # a forward whose backward never runs (torch's shape inference, an abandoned step)
    gc.collect()
    assert gone() is None
    assert meter.bytes == 2 * (2 * 4 * 4)  # the linear's input and the ReLU's output


def test_fake_tensors_are_not_counted_nor_read():
    import warnings

    from lightning_pipe.compat import torch as torch_compat
    from lightning_pipe.measure.memory import _CPUTensorTracker

    tracker = _CPUTensorTracker()
    with torch_compat.fake_tensor_mode():
        fake = torch.empty(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when a fake tensor's data pointer is read
        tracker.track(fake, ())
    assert tracker.live == tracker.peak == 0


# ------------------------------------------------------------------------------------------------ gradient memory
class _Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        from torch.utils.data import DataLoader, TensorDataset

        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 8, generator=g)), batch_size=8)


def _gradient_watch(reads_before_zero_grad: bool):
    import weakref

    class Watch(L.Callback):
        """Whether the gradients held as a batch starts are still alive while its schedule runs the last block."""

        def __init__(self) -> None:
            self.held: list = []
            self.alive: list[bool | None] = []
            self.seen_before_zero_grad: list[bool] = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.held = [weakref.ref(p.grad) for p in module.parameters() if p.grad is not None]
            self.alive.append(None)
            if not hasattr(self, "_hooked"):
                self._hooked = module.net[3].register_forward_hook(self._forward)

        def _forward(self, block, args, output):
            if self.held and self.alive[-1] is None:
                self.alive[-1] = all(ref() is not None for ref in self.held)

    if reads_before_zero_grad:

        def on_before_zero_grad(self, trainer, module, optimizer):
            self.seen_before_zero_grad.append(all(p.grad is not None for p in module.parameters()))

        Watch.on_before_zero_grad = on_before_zero_grad
    return Watch()


def test_the_gradients_lightning_zeroes_after_a_step_are_released_before_its_schedule_runs():
    # The pipeline computes a batch's gradients inside training_step, before Lightning's zero_grad; keeping the
    # previous ones until then held two sets of gradients (and, on the compute-bound benchmark network, made the
    # allocator fault ~3,500 pages a step back in). They go as the step starts when nothing reads them before zero_grad.
    from lightning_pipe import PipelineParallelStrategy
    from tests.models import quiet_trainer

    def fit(strategy, callbacks=()):
        model = _Regression()
        trainer = quiet_trainer(
            max_steps=3, devices=1, strategy=strategy, accumulate_grad_batches=2, callbacks=list(callbacks)
        )
        trainer.fit(model)
        return model

    def pipeline():
        return PipelineParallelStrategy(microbatches=2, stages_per_rank=2, schedule="Interleaved1F1B")

    watch = _gradient_watch(reads_before_zero_grad=False)
    piped = fit(pipeline(), [watch])
    # batch 0: nothing held; batch 1 (inside the window): the window's gradients so far, kept; batches 2 and 4 start
    # windows: the previous window's gradients released; 3 and 5 keep them
    assert watch.alive == [None, True, False, True, False, True]
    reference = fit("auto")
    for a, b in zip(piped.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # A callback that reads them in on_before_zero_grad sees them there, as on one device: they are kept.
    reader = _gradient_watch(reads_before_zero_grad=True)
    fit(pipeline(), [reader])
    assert reader.alive == [None, True, True, True, True, True]
    assert reader.seen_before_zero_grad == [False, True, True]  # none yet as the first window starts


def test_a_hook_set_on_a_callback_instance_keeps_the_gradients_too():
    # The overrides are looked up once per class; a hook set on an instance (or on a class after the first step) is
    # still seen, and the gradients it reads are kept for it.
    import types

    from lightning_pipe import PipelineParallelStrategy
    from tests.models import quiet_trainer

    watch = _gradient_watch(reads_before_zero_grad=False)
    seen: list[bool] = []

    def on_before_zero_grad(self, trainer, module, optimizer):
        seen.append(all(p.grad is not None for p in module.parameters()))

    watch.on_before_zero_grad = types.MethodType(on_before_zero_grad, watch)
    strategy = PipelineParallelStrategy(microbatches=2, stages_per_rank=2, schedule="Interleaved1F1B")
    quiet_trainer(max_steps=3, devices=1, strategy=strategy, accumulate_grad_batches=2, callbacks=[watch]).fit(
        _Regression()
    )
    assert watch.alive == [None, True, True, True, True, True]
    assert seen == [False, True, True]
