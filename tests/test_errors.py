"""Misconfigurations and misuse fail with a clear message naming the argument and the fix (one test per message).

Runs one-process pipelines in the pytest process; the module fixture tears the process group down afterwards.
"""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lightning_pipe
from lightning_pipe import PipelineConfigError, PipelineParallelStrategy, PipelineUsageError
from tests.models import VOCAB, LitLM


@pytest.fixture(scope="module", autouse=True)
def _teardown_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _fit(model, trainer_kwargs=None, **strategy_kwargs):
    trainer = L.Trainer(
        strategy=PipelineParallelStrategy(**strategy_kwargs),
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **(trainer_kwargs or {}),
    )
    trainer.fit(model)
    return trainer


def test_registered_name():
    trainer = L.Trainer(strategy="pipeline", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, lightning_pipe.PipelineParallelStrategy)


def test_constructor_rejects_unknown_schedule():
    with pytest.raises(PipelineConfigError, match=r"Unknown `schedule='Zigzag'`"):
        PipelineParallelStrategy(schedule="Zigzag")


def test_constructor_rejects_both_split_settings():
    with pytest.raises(PipelineConfigError, match="Set either `split_points` or `balance`, not both"):
        PipelineParallelStrategy(split_points=["layers.4"], balance=[4, 4])


@pytest.mark.parametrize("bad", ["even", 3, [1.5, 2], [True, 1]])
def test_constructor_rejects_bad_balance(bad):
    with pytest.raises(PipelineConfigError, match="`balance"):
        PipelineParallelStrategy(balance=bad)


def test_constructor_rejects_both_microbatch_settings():
    with pytest.raises(PipelineConfigError, match=r"Set either `microbatches` \(4\) or `microbatch_size` \(2\)"):
        PipelineParallelStrategy(microbatches=4, microbatch_size=2)


def test_constructor_rejects_bad_microbatch_values():
    with pytest.raises(PipelineConfigError, match=r"`microbatches` must be 'auto' or an int >= 1, got 0"):
        PipelineParallelStrategy(microbatches=0)
    with pytest.raises(PipelineConfigError, match=r"`microbatch_size`.*None or an int >= 1, got -2"):
        PipelineParallelStrategy(microbatch_size=-2)


def test_constructor_rejects_unknown_frontend():
    with pytest.raises(
        PipelineConfigError, match=r"`frontend='jit'` is not one of 'auto', 'modules', 'dataflow', 'trace'"
    ):
        PipelineParallelStrategy(frontend="jit")


def test_pipeline_size_is_resolved_later():
    with pytest.raises(
        PipelineUsageError, match=r"`pipeline_size` is resolved.*processes start.*\(setup_environment\)"
    ):
        _ = PipelineParallelStrategy().pipeline_size


def test_fp16_mixed_with_grad_scaler_is_refused():
    # On CUDA, '16-mixed' comes with a GradScaler; on CPU Lightning uses none, so pass one explicitly.
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(PipelineConfigError, match=r"`precision='16-mixed'` needs a gradient scaler"):
        _fit(LitLM(), trainer_kwargs={"plugins": [plugin]})


def test_batch_not_divisible_by_microbatches_runs_as_a_count_that_divides_it():
    model = LitLM()
    _fit(model, microbatches=3)  # batches of 8 run as 4 microbatches of 2
    assert len(model.step_losses) == 2


class _CallsTwice(LitLM):
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x) + self(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


class _NeverCalls(LitLM):
    def training_step(self, batch, batch_idx):
        return torch.zeros((), requires_grad=True)


class _ReturnsVector(LitLM):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1), reduction="none")


class _LogsPositionally(LitLM):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))
        self.log("train_loss", loss, True)
        return loss


class _CallsOutsideStep(LitLM):
    def on_train_start(self):
        self(torch.zeros(2, 6, dtype=torch.long))


@pytest.mark.parametrize(
    "model_cls, match",
    [
        (_CallsTwice, "called the pipelined network more than once"),
        (_NeverCalls, "returned without calling the pipelined network"),
        (_ReturnsVector, "must return a scalar loss tensor"),
        (_LogsPositionally, r"Pass `self.log\('train_loss', ...\)` options by keyword"),
        (_CallsOutsideStep, "was called outside a training, validation, test or predict step"),
    ],
)
def test_step_misuse(model_cls, match):
    with pytest.raises(PipelineUsageError, match=match):
        _fit(model_cls())


def test_one_process_pipeline_trains_in_process():
    trainer = _fit(LitLM())
    assert trainer.strategy.pipeline_size == 1 and trainer.strategy.schedule_name == "1F1B"
    assert trainer.global_step == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, original",
    [
        ("none-unit", "TypeError: 'NoneType' object is not callable"),
        ("input-shape", "ValueError: too many values to unpack"),
    ],
)
def test_error_inside_a_stage_names_rank_stage_and_the_activation(kind, original):
    from tests.launch import run_script

    proc = run_script("stage_errors.py", kind, nprocs=2, expect_failure=True, timeout=300)
    err = " ".join(proc.stderr.split())
    assert original in err  # the user's own exception, with its traceback
    assert "stage_errors.py" in err and "forward" in err
    # torch runs each stage once for its shape inference before the first microbatch: that is where it fails.
    note = "lightning-pipe: raised on rank 1 in pipeline stage 1 of 2 during torch's shape inference."
    assert note in err
    assert "Units held by other stages are absent (None) here: embed, layers.0, layers.1." in err
    assert "On this stage `idx` holds the activation received from stage 0 (tensor (4, 6, 16) float32)" in err
    assert "errors-raised-inside-a-stage" in err
