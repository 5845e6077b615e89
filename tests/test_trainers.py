"""Trainers one after another on one LightningModule: what each installs ends with it (docs/architecture.md)."""

from __future__ import annotations

import lightning.pytorch as L
import pytest

from tests.launch import run_script
from tests.models import LitLM, quiet_trainer
from tests.reference import assert_parity, load_ranks


def _single_device_two_fits() -> tuple[list[float], dict]:
    """The same two fits on one device: the second Trainer makes a new optimizer and restarts the data."""
    L.seed_everything(0)
    model = LitLM(n_layers=8)
    for _ in range(2):
        quiet_trainer(devices=1, max_steps=3).fit(model)
    return model.step_losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def second_trainer(tmp_path_factory):
    out = tmp_path_factory.mktemp("second")
    proc = run_script("second_trainer.py", str(out), nprocs=2)
    return load_ranks(out, "second"), proc.stdout + proc.stderr


@pytest.mark.extended
@pytest.mark.slow
def test_a_second_trainer_with_another_schedule_equals_one_device(second_trainer):
    ranks, _ = second_trainer
    losses, state = _single_device_two_fits()
    assert len(losses) == 6
    assert_parity(ranks, losses, state)


@pytest.mark.extended
@pytest.mark.slow
def test_activation_checkpointing_is_on_then_off(second_trainer):
    ranks, _ = second_trainer
    for r in ranks:
        with_checkpointing, without = r["saved"]
        assert r["checkpointed"][0] and r["checkpointed"][1] == []
        # Every block of the second Trainer keeps its activations: more saved for backward, per stage.
        for stage, saved in without.items():
            assert saved > 2 * with_checkpointing[stage], (stage, saved, with_checkpointing[stage])
        # The checkpointing forwards were removed when each Trainer ended.
        assert r["forwards_after"] == [0, 0]


@pytest.mark.extended
@pytest.mark.slow
def test_other_stages_are_refused_and_nothing_trains(second_trainer):
    ranks, _ = second_trainer
    for r in ranks:
        assert "already split into other pipeline stages" in r["refused"]
        assert "placement='loop' (schedule Interleaved1F1B)" in r["refused"] and "stages_per_rank=2" in r["refused"]
        assert r["steps_after_refusal"] == 6


@pytest.mark.extended
@pytest.mark.slow
def test_a_last_batch_1f1b_cannot_run_runs_under_gpipe_as_on_one_device(second_trainer):
    ranks, output = second_trainer
    L.seed_everything(0)
    model = LitLM(n_layers=8, samples=17)
    quiet_trainer(devices=1, max_steps=3).fit(model)
    assert len(model.step_losses) == 3  # the third step is the batch of 1
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert_parity(
        [{**r, "losses": r["short_batch_losses"], "state": r["short_batch_state"]} for r in ranks],
        model.step_losses,
        state,
    )
    said = " ".join(output.split())
    assert (
        "the training DataLoader's last batch of each epoch (17 samples in batches of 8) has 1 samples, which torch's"
        " 1F1B schedule cannot run as equal microbatches on 2 stages: it runs as 1 microbatch of 1 under GPipe, on the"
        " same stages"
    ) in said


@pytest.mark.extended
@pytest.mark.slow
def test_the_model_summary_says_it_counts_one_rank(second_trainer):
    _, output = second_trainer
    whole = sum(p.numel() for p in LitLM(n_layers=8).parameters())
    line = next(line for line in output.splitlines() if "the model summary below counts" in line)
    assert f"the whole model has {whole / 1e3:.1f} K parameters" in line and "stages [0]" in line
    assert "Total params" in output


@pytest.mark.extended
@pytest.mark.slow
def test_library_warnings_are_shown_once_not_once_per_rank(second_trainer):
    _, output = second_trainer
    # One part per Trainer (rank 0 opens each with "GPU available"); rank 1's lines land in the same part.
    trainers = output.split("GPU available")[1:]
    assert len(trainers) == 4
    notices = [[line for line in part.splitlines() if "is deprecated" in line] for part in trainers]
    # torch 2.13 deprecates the pytree `LeafSpec` that Lightning 2.6 uses: rank 0 shows it, rank 1 does not.
    assert notices[0]
    assert all(len(lines) == len(set(lines)) for lines in notices), notices
