"""Exact resume, in one process: resume points, resumable training loaders, the two halves of a save, the newest
complete checkpoint, and the settings of restarts and asynchronous saves."""

from __future__ import annotations

import io
import json
import os
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

import lightning_pipe
from lightning_pipe.checkpoint import format as fmt
from lightning_pipe.checkpoint import latest, save
from lightning_pipe.errors import MicrobatchError, PipelineConfigError
from lightning_pipe.reliability import loaders, restart
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.step.report import check_training_batches
from lightning_pipe.step.rng import RngStreams
from tests.models import quiet_trainer, token_dataset
from tests.resume_models import ShuffledDropoutLM

# ---------------------------------------------------------------------------------------------------- units


def test_random_streams_round_trip_through_a_weights_only_file():
    streams = RngStreams()
    with streams.compute():
        torch.rand(2)  # the compute stream exists from now on
    buffer = io.BytesIO()
    torch.save(streams.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    with streams.compute():
        dropout = torch.rand(3)
    expected = (torch.rand(3), random.random(), float(np.random.rand()), dropout)
    streams.load_state_dict(state)
    with streams.compute():
        again = torch.rand(3)
    assert torch.equal(expected[0], torch.rand(3)) and expected[1] == random.random()
    assert expected[2] == float(np.random.rand()) and torch.equal(again, dropout)


def test_sampler_draws_its_order_when_primed_and_skips_on_request():
    sampler = loaders.ResumableSampler(RandomSampler(range(10)))
    torch.manual_seed(3)
    sampler.new_epoch()
    full = list(sampler)
    torch.manual_seed(3)
    sampler.new_epoch(skip=4)
    sampler.prime()
    torch.rand(5)  # draws after priming change nothing: the order was drawn
    assert list(sampler) == full[4:] and len(sampler) == 10


def test_sampler_starts_its_epoch_at_the_first_index_asked_for():
    # as a generator would: what is drawn between `iter()` and the first index belongs before the epoch's order
    sampler = loaders.ResumableSampler(RandomSampler(range(10)))
    torch.manual_seed(3)
    sampler.new_epoch()
    indices = iter(sampler)
    torch.rand(5)
    late = list(indices)
    torch.manual_seed(3)
    torch.rand(5)
    assert late == list(sampler) and sorted(late) == list(range(10))


def test_sampler_passes_set_epoch_on():
    seen = []

    class Epochs(list):
        def set_epoch(self, epoch):
            seen.append(epoch)

    loaders.ResumableSampler(Epochs([1, 2])).set_epoch(7)
    loaders.ResumableSampler([1, 2]).set_epoch(7)  # no set_epoch: nothing to pass on
    assert seen == [7]


def test_stand_ins_by_kind_of_loader():
    continuation = loaders.Continuation(lambda: {}, lambda state: None, lambda: 0)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    class Stateful(DataLoader):
        def state_dict(self):
            return {"at": 3}

        def load_state_dict(self, state):
            self.loaded = state

    resumable = loaders.stand_in(DataLoader(token_dataset(8), batch_size=4, shuffle=True), continuation)
    assert type(resumable) is loaders.ResumableLoader and hasattr(resumable, "state_dict")
    assert isinstance(resumable.sampler, loaders.ResumableSampler) and len(resumable) == 2
    assert type(loaders.stand_in(DataLoader(Stream(), batch_size=2), continuation)) is loaders.PassLoader
    assert not hasattr(loaders.PassLoader(DataLoader(Stream()), continuation), "load_state_dict")
    stateful = loaders.stand_in(Stateful(token_dataset(8), batch_size=4), continuation)
    assert type(stateful) is loaders.StatefulPassLoader and stateful.state_dict() == {"at": 3}
    stateful.load_state_dict({"at": 1})
    assert stateful.loader.loaded == {"at": 1}
    assert [loader.index for loader in continuation.loaders] == [0, 1, 2, 3]


def test_the_fit_start_batch_check_sees_through_the_stand_in(monkeypatch):
    # Lightning hands the strategy the stand-in, not the user's DataLoader: the short last batch is still found.
    from lightning_pipe.step import report

    said: list[str] = []
    monkeypatch.setattr(report, "rank_zero_info", said.append)
    continuation = loaders.Continuation(lambda: {}, lambda state: None, lambda: 0)
    settings = PipelineSettings(microbatches=8).resolve(2)
    for loader in (
        DataLoader(token_dataset(57), batch_size=8),
        DataLoader(token_dataset(57), batch_size=8, shuffle=True),
    ):
        trainer = SimpleNamespace(train_dataloader=loaders.stand_in(loader, continuation))
        # a 1-sample batch 1F1B cannot run with 2 stages (it needs 2 microbatches): GPipe runs it
        check_training_batches(trainer, settings, global_rank=0)
    assert len(said) == 2 and all(
        "last batch of each epoch (57 samples in batches of 8) has 1 samples" in text and "under GPipe" in text
        for text in said
    )


def test_a_batch_no_schedule_runs_is_refused_at_fit_start_on_rank_0_and_pointed_to_on_the_others(monkeypatch):
    # No schedule of torch 2.11-2.14 refuses every count of a training batch (1F1B and DualPipeV hand theirs to a
    # fallback): a torch whose Interleaved1F1B accepted none is simulated.
    from lightning_pipe.step.executors import schedule

    monkeypatch.setattr(schedule, "schedule_accepts", lambda *args: False)
    settings = PipelineSettings(schedule="Interleaved1F1B", microbatches=8).resolve(2)
    trainer = SimpleNamespace(train_dataloader=DataLoader(token_dataset(57), batch_size=8))
    with pytest.raises(MicrobatchError) as first:
        check_training_batches(trainer, settings, global_rank=0)
    text = str(first.value)
    assert text.startswith("The training DataLoader's last batch of each epoch (57 samples in batches of 8) has 1")
    assert "torch's Interleaved1F1B schedule with 4 stages accepts no count" in text
    assert text.endswith("(Checked before the first step.)")
    with pytest.raises(
        MicrobatchError, match=r"^The training DataLoader.*batch.*cannot be split.*microbatches; rank 0 says why"
    ):
        check_training_batches(trainer, settings, global_rank=1)


def test_a_resume_point_is_taken_at_the_next_batch_request():
    counter = iter(range(100))
    continuation = loaders.Continuation(lambda: {"n": next(counter)}, lambda state: None, lambda: 0)
    loader = loaders.stand_in(DataLoader(token_dataset(8), batch_size=4), continuation)
    taken = []
    iterator = iter(loader)
    continuation.when_training_continues(taken.append)
    assert taken == []  # nothing until a batch is asked for
    next(iterator)
    # Taken before the epoch's draws: the first epoch has no start to replay yet.
    assert taken == [{"streams": {"n": 0}, "epoch_starts": [None]}]
    continuation.when_training_continues(taken.append)
    next(iterator)
    assert len(taken) == 2 and taken[1]["streams"] == {"n": 1} and taken[1]["epoch_starts"][0]["global"] is not None


def test_settings_of_restarts_and_asynchronous_saves():
    assert PipelineSettings(max_restarts=3, async_checkpoint=True).max_restarts == 3
    with pytest.raises(PipelineConfigError, match=r"`max_restarts=-1` must be an int >= 0.*--max-restarts"):
        PipelineSettings(max_restarts=-1)
    with pytest.raises(PipelineConfigError, match=r"`async_checkpoint='yes'` must be True"):
        PipelineSettings(async_checkpoint="yes")
    with pytest.raises(PipelineConfigError, match="max_restarts"):
        lightning_pipe.PipelineParallelStrategy(max_restarts=1.5)


def test_max_restarts_under_lightnings_launcher_is_for_one_node():
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_pipe.reliability.launcher import PipelineLauncher

    launcher = PipelineLauncher(LightningEnvironment(), 2, 2, None, max_restarts=2)
    with pytest.raises(PipelineConfigError, match=r"`max_restarts=2`.*`num_nodes=2`.*--max-restarts=2"):
        launcher._supervise()


def test_restart_count_and_the_run_record(tmp_path, monkeypatch):
    for name in ("TORCHELASTIC_RESTART_COUNT", restart.RESTART_COUNT, restart.RUN_RECORD):
        monkeypatch.delenv(name, raising=False)
    assert restart.restart_count() == 0
    monkeypatch.setenv(restart.RESTART_COUNT, "2")
    assert restart.restart_count() == 2
    restart.record_checkpoint_dirs([str(tmp_path / "a")], 2)  # not a supervised run: nowhere to record
    assert restart.recorded_checkpoint_dirs(2) == []
    monkeypatch.setenv(restart.RUN_RECORD, str(tmp_path / "record.json"))
    restart.record_checkpoint_dirs([str(tmp_path / "a")], 2)
    restart.record_checkpoint_dirs([str(tmp_path / "b"), str(tmp_path / "a")], 2)
    assert restart.recorded_checkpoint_dirs(2) == [str(tmp_path / "a"), str(tmp_path / "b")]


# ---------------------------------------------------------------------------------------------------- in one process


def fit(out: Path, ckpt_path=None, **strategy) -> list[float]:
    """The uninterrupted run (``ckpt_path=None``: checkpoints every 4 steps and at epoch ends, 10 batches an epoch,
    validation every 4 batches) or a resumed one; its per-step losses."""
    L.seed_everything(0)
    module = ShuffledDropoutLM(n_layers=4, lr=0.01)
    callbacks = []
    if ckpt_path is None:
        callbacks = [
            ModelCheckpoint(dirpath=out, every_n_train_steps=4, save_top_k=-1, filename="{step}"),
            ModelCheckpoint(dirpath=out, save_on_train_epoch_end=True, save_top_k=-1, filename="end-{step}"),
        ]
    trainer = quiet_trainer(
        strategy=lightning_pipe.PipelineParallelStrategy(**strategy),
        devices=1,
        max_steps=24,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        val_check_interval=4,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module.step_losses


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    return out, fit(out, async_checkpoint=True)


@pytest.mark.parametrize(
    "name,step",
    [
        ("step=8.ckpt", 8),  # mid-epoch, saved at the end of a step after which validation runs
        ("end-step=10.ckpt", 10),  # at an epoch boundary
        ("step=12.ckpt", 12),  # mid-epoch
    ],
)
def test_a_shuffling_loader_resumes_as_if_never_stopped(uninterrupted, tmp_path, name, step):
    out, losses = uninterrupted
    assert len(losses) == 24
    assert fit(tmp_path, ckpt_path=str(out / name)) == losses[step:]


def test_every_checkpoint_is_complete_and_the_newest_is_found(uninterrupted, tmp_path):
    out, _ = uninterrupted
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        ["end-step=10.ckpt", "end-step=20.ckpt", "end-step=24.ckpt"]
        + [f"step={s}.ckpt" for s in (4, 8, 12, 16, 20, 24)]
    )
    manifest = json.loads((out / "step=12.ckpt" / fmt.MANIFEST).read_text())
    assert manifest[fmt.GLOBAL_STEP] == 12 and manifest[fmt.RESUME_FILES] == ["resume/rank0.pt"]
    work = tmp_path / "ckpt"
    for name in ("step=12.ckpt", "step=16.ckpt", "step=20.ckpt"):
        shutil.copytree(out / name, work / name)
    assert latest.newest_complete([work]).path == work / "step=20.ckpt"
    # An incomplete newer save (no manifest) is not picked; a missing resume point makes a checkpoint incomplete.
    os.rename(work / "step=20.ckpt", work / "step=20.ckpt.tmp-ab12")
    (work / "step=20.ckpt.tmp-ab12" / fmt.MANIFEST).unlink()
    (work / "step=16.ckpt" / "resume" / "rank0.pt").unlink()
    assert latest.newest_complete([work]).path == work / "step=12.ckpt"
    # A complete save killed before its rename is finished; a replaced checkpoint left alone is given its name back.
    shutil.copytree(out / "step=24.ckpt", work / "step=24.ckpt.tmp-cd34")
    found = latest.newest_complete([work, tmp_path / "missing"])
    assert found.path == work / "step=24.ckpt" and found.global_step == 24 and (work / "step=24.ckpt").is_dir()
    os.rename(work / "step=24.ckpt", work / "step=24.ckpt.old-ef56")
    assert latest.newest_complete([work]).path == work / "step=24.ckpt"
    assert latest.newest_complete([tmp_path / "empty"]) is None


def test_a_removal_waits_for_the_newer_save_and_a_pending_save_of_the_name_is_dropped(tmp_path):
    writer = save.CheckpointWriter(topology=lambda: None)  # removals and pending saves need no process group
    old = tmp_path / "step=4.ckpt"
    old.mkdir()
    pending = save.PendingSave(tmp_path / "step=8.ckpt", tmp_path / "step=8.ckpt.tmp-1", "1", manifest=None)
    pending.tmp.mkdir()
    writer._pending.append(pending)
    writer.remove(old, "2")
    assert old.is_dir() and pending.removals == [old]
    pending.resume_written = True
    writer._commit_if_ready(pending)  # not global rank 0 (no manifest): nothing renamed, the removal runs
    assert pending.committed and not old.exists()
    other = save.PendingSave(tmp_path / "x.ckpt", tmp_path / "x.ckpt.tmp-3", "3", manifest=None)
    other.tmp.mkdir()
    writer._pending.append(other)
    writer.remove(tmp_path / "x.ckpt", "4")
    assert not other.tmp.exists() and other not in writer.pending
