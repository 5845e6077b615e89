"""The tuner's layout search, pure parts: the layouts of a space, the per-replica batch that keeps the global batch,
the cost model's communication and memory per layout, the record and LightningCLI config that carry the layout."""

from __future__ import annotations

import dataclasses
import os

import lightning.pytorch as L
import pytest
import torch

from lightning_pipe import PipelineConfigError, PipelineParallelStrategy
from lightning_pipe.models.units import Layout
from lightning_pipe.tune import prune, record
from lightning_pipe.tune.cost import BalanceRule, Calibration, Profile, UnitTimes, predict
from lightning_pipe.tune.layout import (
    ProcessLayout,
    data_parallel_seconds,
    find_batch_knob,
    layouts,
    ring_seconds,
    state_bytes,
)
from lightning_pipe.tune.space import Candidate, SearchSpace, candidates

OWN = ProcessLayout(4, 1, 1, "ddp")
LAYOUTS = SearchSpace(pipeline_sizes="auto", data_parallel=("ddp", "fsdp"))


def test_every_split_of_the_processes_the_strategys_own_first():
    found, notes = layouts(LAYOUTS, 4, OWN, global_batch=8)
    assert found[0] == OWN
    assert set(found) == {
        ProcessLayout(1, 4, 1, "ddp"),
        ProcessLayout(1, 4, 1, "fsdp"),
        ProcessLayout(2, 2, 1, "ddp"),
        ProcessLayout(2, 2, 1, "fsdp"),
        OWN,  # one replica: nothing to shard, "fsdp" is the same layout
    }
    assert notes == []
    # tensor parallelism: p x d x t = 4, a size that does not divide the processes is named
    found, notes = layouts(SearchSpace(pipeline_sizes=(1, 2), tensor_parallel=(1, 2, 3)), 4, OWN, 8)
    assert ProcessLayout(2, 1, 2, "ddp") in found and ProcessLayout(1, 2, 2, "ddp") in found
    assert ProcessLayout(1, 4, 1, "ddp") in found
    assert notes == ["tensor_parallel=3 does not divide the 4 processes: left out."]
    assert SearchSpace().searches_layout is False and LAYOUTS.searches_layout is True


def test_layouts_that_would_change_the_global_batch_are_left_out_with_the_reason():
    found, notes = layouts(LAYOUTS, 4, OWN, global_batch=None)
    assert found == [OWN]
    assert "no `batch_size` attribute or hyperparameter" in notes[0]
    assert "left out pp=1 tp=1 (4 replicas), pp=2 tp=1 (2 replicas)" in notes[0]
    found, notes = layouts(LAYOUTS, 4, OWN, global_batch=6)
    assert set(found) == {OWN, ProcessLayout(2, 2, 1, "ddp"), ProcessLayout(2, 2, 1, "fsdp")}
    assert (
        "the global batch (6 samples) does not divide among their replicas: left out pp=1 tp=1 (4 replicas)"
        in (notes[0])
    )


def test_search_space_layout_values_and_errors():
    space = SearchSpace(pipeline_sizes=(4, 1, 1), data_parallel=("fsdp", "ddp", "fsdp"), tensor_parallel=(2, 1))
    assert (space.pipeline_sizes, space.data_parallel, space.tensor_parallel) == ((1, 4), ("fsdp", "ddp"), (1, 2))
    assert space.as_dict()["pipeline_sizes"] == [1, 4]
    assert "pipeline_sizes" not in SearchSpace().as_dict()  # earlier records keep their fingerprint
    with pytest.raises(PipelineConfigError, match=r"SearchSpace\(data_parallel=\('zero',\)\)` must be .* 'fsdp'"):
        SearchSpace(data_parallel=("zero",))
    with pytest.raises(PipelineConfigError, match=r"SearchSpace\(pipeline_sizes=\(0,\)\)` must be .* ints >= 1"):
        SearchSpace(pipeline_sizes=(0,))
    with pytest.raises(PipelineConfigError, match=r"SearchSpace\(tensor_parallel=\(\)\)"):
        SearchSpace(tensor_parallel=())


def test_no_pipeline_candidates_take_one_stage_and_carry_their_layout():
    plain = ProcessLayout(1, 4, 1, "fsdp")
    found = candidates(SearchSpace(microbatches=(1, 2)), 4, 2, 4, plain)
    assert {c.schedule for c in found} == {"GPipe", "1F1B"}
    assert {(c.stages_per_rank, c.pipeline_size, c.data_parallel, c.tensor_parallel) for c in found} == {
        (1, 1, "fsdp", 1)
    }
    first = found[0]
    assert first.label == "no pipeline fsdp tp=1 | GPipe M=1 v=1"
    assert first.settings()["pipeline_size"] == 1 and first.settings()["data_parallel"] == "fsdp"
    assert "pipeline_size" not in Candidate("1F1B", 4, 1).settings()  # no layout searched: the strategy's own
    assert ProcessLayout.of(found[0], 4) == plain
    # Candidates of different layouts are corrected apart: each layout's communication is a model until measured
    assert prune.group(found[0]) != prune.group(dataclasses.replace(found[0], pipeline_size=2))


# ---------------------------------------------------------------------------------------------------- cost model
def _profile(blocks: int = 4, global_batch: int = 8) -> Profile:
    """Blocks of 1 ms per sample forward and 2 ms backward, a head twice as expensive, 4000 parameter bytes per unit;
    profiled for the strategy's layout (4 processes, one pipeline) at every microbatch size."""
    layout = Layout(("embed",), tuple(f"layers.{i}" for i in range(blocks)), ("head",))
    times = {}
    for size in (1, 2, 4, 8):
        unit = UnitTimes(1e-3 * size, 2e-3 * size, 1e-3 * size, 1000 * size, 100 * size, 100 * size)
        head = UnitTimes(2e-3 * size, 4e-3 * size, 2e-3 * size, 3000 * size, 100 * size, 900 * size)
        embed = UnitTimes(1e-4 * size, 1e-4 * size, 0.0, 10, 0, 100 * size)
        times[size] = {"embed": embed, "head": head, **{b: unit for b in layout.blocks}}
    params = {u: 1000 for u in layout.units}
    return Profile(layout, params, {u: 4000 for u in layout.units}, times, global_batch, 4, global_batch)


def _step(candidate: Candidate, calibration: Calibration):
    return predict(candidate, _profile(), BalanceRule("blocks"), 4, calibration)


def test_every_layout_gets_one_trial_however_slow_its_prediction():
    """A layout's prediction is a model until one of its candidates runs, and can be off by more than the margin
    (benchmarks/tune.py --layouts): after the first trial, each layout not measured yet has its fastest predicted
    candidate (within the memory limit) tried next, whatever the margin; then the margin rules as before."""
    from lightning_pipe.tune import prune
    from lightning_pipe.tune.cost import Prediction

    def cand(pp: int, mode: str, schedule: str = "1F1B", m: int = 2) -> Candidate:
        return Candidate(schedule, m, 1, pipeline_size=pp, data_parallel=mode, tensor_parallel=1)

    pipe, pipe4, alone, alone2, sharded = cand(2, "ddp"), cand(2, "ddp", m=4), cand(1, "ddp", "GPipe", 1), \
        cand(1, "ddp", "GPipe", 2), cand(1, "fsdp", "GPipe", 1)  # fmt: skip
    predictions = {
        pipe: Prediction(1.0, 0.0, (1.0,)),
        pipe4: Prediction(1.5, 0.0, (1.0,)),
        alone: Prediction(2.5, 0.0, (1.0,)),
        alone2: Prediction(2.6, 0.0, (1.0,)),
        sharded: Prediction(3.0, 0.0, (99.0,)),
    }
    assert prune.next_trial(predictions, {}, None, 0.1) == pipe  # the fastest predicted first
    measured = {pipe: prune.Measured(1.0, 1.0, 1.0)}
    # No pipeline is predicted 2.5 times slower: tried anyway, as its layout has no trial; FSDP's is over the limit.
    assert prune.untried_layouts(predictions, measured, 10) == [alone]
    assert prune.next_trial(predictions, measured, 10, 0.1) == alone
    assert prune.next_trial(predictions, measured, None, 0.1) == alone  # then FSDP's (within no limit)
    measured[alone] = prune.Measured(0.4, 0.4, 1.0)  # measured faster than the pipeline
    assert prune.next_trial(predictions, measured, None, 0.1) == sharded
    measured[sharded] = prune.Measured(3.0, 3.0, 1.0)
    # Every layout tried: the margin rules again, predictions against the best's prediction (alone's 2.5): pipe4's
    # 1.5 and alone2's 2.6 are within twice the margin (their groups untried), fastest predicted first.
    assert prune.worth_a_trial(predictions, measured, None, 0.1) == [pipe4, alone2]
    assert prune.next_trial(predictions, measured, None, 0.1) == pipe4
    rows = {r.candidate: r.status for r in prune.rows(predictions, {pipe: measured[pipe]}, pipe, 10, 0.1)}
    assert rows[alone] == prune.UNTRIED and rows[pipe4] == prune.SLOWER and rows[sharded] == prune.OVER_MEMORY
    # Without a layout in the space, all candidates share one: nothing changes.
    plain = {
        Candidate("1F1B", 2, 1): Prediction(1.0, 0.0, (1.0,)),
        Candidate("GPipe", 8, 1): Prediction(2.0, 0.0, (1.0,)),
    }
    assert prune.next_trial(plain, {Candidate("1F1B", 2, 1): prune.Measured(1.0, 1.0, 1.0)}, None, 0.1) is None


def test_ring_collectives_and_the_gradient_synchronisation():
    assert ring_seconds((1e-4, 1e-9), 4e6, 4) == pytest.approx(3 * (1e-4 + 1e-9 * 1e6))
    assert ring_seconds((1e-4, 1e-9), 4e6, 1) == 0.0
    assert data_parallel_seconds((1e-4, 1e-9), 4e6, 4) == pytest.approx(2 * ring_seconds((1e-4, 1e-9), 4e6, 4))


def test_plain_data_parallelism_wins_when_the_model_is_small_and_the_link_fast():
    fast = Calibration(collective=(1e-5, 1e-10))
    plain = ProcessLayout(1, 4, 1, "ddp").carried_by(Candidate("1F1B", 1, 1))
    piped = OWN.carried_by(Candidate("1F1B", 4, 1))
    no_pipeline, pipeline = _step(plain, fast), _step(piped, fast)
    # 2 samples per replica, one stage: every unit's forward and backward once, no bubble; then the all-reduce
    compute = 2 * (2e-4 + 4 * 3e-3 + 6e-3)
    assert no_pipeline.span == pytest.approx(compute)
    assert no_pipeline.sync == pytest.approx(data_parallel_seconds((1e-5, 1e-10), 6 * 4000, 4))
    assert no_pipeline.step < pipeline.step and pipeline.sync == 0.0
    # A slow link: the gradient all-reduce of the whole model over 4 replicas costs more than the pipeline's bubble
    slow = Calibration(collective=(1e-3, 1e-5))
    assert _step(plain, slow).step > _step(piped, slow).step


def test_fsdp_holds_less_state_and_the_memory_limit_prunes_the_whole_copies():
    adam = Calibration(state_factor=3.0)  # a gradient and two moments per parameter
    ddp = ProcessLayout(1, 4, 1, "ddp").carried_by(Candidate("1F1B", 1, 1))
    fsdp = dataclasses.replace(ddp, data_parallel="fsdp")
    assert state_bytes(24000, 3.0, ProcessLayout(1, 4, 1, "ddp")) == 24000 * 4
    # the shard of parameters, gradients and state, plus the gathered parameters and their whole gradients
    assert state_bytes(24000, 3.0, ProcessLayout(1, 4, 1, "fsdp")) == 24000 * (2 + 4 / 4)
    assert state_bytes(24000, 3.0, ProcessLayout(1, 2, 2, "ddp")) == 12000 * 4
    predictions = {c: _step(c, adam) for c in (ddp, fsdp)}
    assert predictions[fsdp].peak < predictions[ddp].peak
    limit = (predictions[fsdp].peak + predictions[ddp].peak) / 2
    assert prune.worth_a_trial(predictions, {}, limit, 0.1) == [fsdp]


def test_tensor_parallelism_shares_the_compute_and_all_reduces_each_blocks_output():
    calibration = Calibration(collective=(1e-5, 1e-10))
    one = _step(ProcessLayout(1, 4, 1, "ddp").carried_by(Candidate("GPipe", 1, 1)), calibration)
    two = _step(ProcessLayout(1, 2, 2, "ddp").carried_by(Candidate("GPipe", 1, 1)), calibration)
    # 4 samples per replica at tp=2 (2 replicas), each process computes half of every unit: the same compute as
    # 2 samples whole, plus 4 blocks x (forward + backward) x 4 rings of their output over 2 processes
    rings = 8 * 4 * ring_seconds((1e-5, 1e-10), 400, 2)
    assert two.span == pytest.approx(one.span + rings)


# ---------------------------------------------------------------------------------------------- batch and record
class WithHparam(L.LightningModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()


class WithAttribute(L.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 16


def test_the_per_replica_batch_is_found_where_lightnings_batch_size_finder_looks():
    model = WithHparam()
    knob = find_batch_knob(model, WithAttribute())
    assert (knob.section, knob.in_hparams, knob.value) == ("model", True, 8)
    knob.set(2)
    assert model.hparams.batch_size == 2
    knob.restore()
    assert model.hparams.batch_size == 8
    data = WithAttribute()
    knob = find_batch_knob(L.LightningModule(), data)
    assert (knob.section, knob.in_hparams, knob.value) == ("data", False, 16)
    knob.set(4)
    assert data.batch_size == 4
    assert find_batch_knob(L.LightningModule(), None) is None


def test_the_record_and_cli_config_carry_the_layout_and_the_batch(tmp_path):
    from jsonargparse import ArgumentParser

    choice = ProcessLayout(1, 4, 1, "fsdp").carried_by(Candidate("1F1B", 2, 1))
    batch = {"section": "model", "batch_size": 2}
    saved = record.TuneRecord("x", choice, settings=choice.settings(), batch=batch)
    _, yaml_file = record.save(saved, tmp_path / "t")
    assert record.load(tmp_path / "t", "x") == saved
    parser = ArgumentParser()
    parser.add_argument("--trainer.strategy", type=PipelineParallelStrategy)
    parser.add_argument("--model.batch_size", type=int, default=8)
    parser.add_argument("--config", action="config")
    config = parser.parse_args(["--config", str(yaml_file)])
    assert config["model.batch_size"] == 2
    strategy = parser.instantiate_classes(config)["trainer.strategy"]
    settings = strategy.settings
    assert (settings.pipeline_size, settings.data_parallel, settings.tensor_parallel) == (1, "fsdp", 1)
    assert (settings.schedule, settings.microbatches) == ("1F1B", 2)


# ---------------------------------------------------------------------------------------------------- tune()
@pytest.mark.slow
@pytest.mark.extended
def test_tune_chooses_the_layout_at_four_processes(tmp_path):
    import torch
    import yaml

    from tests.launch import run_script

    proc = run_script("tune_layout.py", str(tmp_path), nprocs=4, launcher="lightning", timeout=1500)
    ranks = [torch.load(tmp_path / f"tune_layout.rank{r}.pt", weights_only=False) for r in range(4)]
    first = ranks[0]
    for other in ranks[1:]:
        for key in ("choice", "settings", "batch_size", "rows", "ran", "again", "cli"):
            assert other[key] == first[key], key
    choice = first["choice"]
    # Several layouts measured, the strategy's own (a 4-stage pipeline) among them, and the fastest chosen.
    measured = {c: step for c, _, step in first["rows"] if step is not None}
    assert (4, "ddp") in {(c.pipeline_size, c.data_parallel) for c in measured}, first["table"]
    assert len({(c.pipeline_size, c.data_parallel) for c in measured}) >= 3, first["table"]
    assert measured[choice] == min(measured.values())
    assert "no pipeline ddp tp=1" in first["table"]
    # A model whose copies fit: with a core per process, no pipeline (plain data parallelism) is fastest. With fewer
    # cores the 4 processes take turns, a pipeline's idle ranks cost nothing, and the measurement decides.
    if (os.cpu_count() or 1) >= 4:
        assert choice.pipeline_size == 1, first["table"]
    said = [n for n in first["notes"] if n.startswith("No pipeline is fastest within the memory limit")]
    assert len(said) == (choice.pipeline_size == 1)
    assert (proc.stdout + proc.stderr).count("No pipeline is fastest") == len(said)
    # The global batch (8 samples per step) stays: 8 / replicas per replica; the fit ran with the layout.
    replicas = 4 // choice.pipeline_size
    size = 8 // replicas
    assert first["batch_size"] == (size if replicas > 1 else None)
    assert first["ran"] == (
        (choice.pipeline_size, replicas, choice.data_parallel, "1F1B", choice.microbatches),
        size,
        2,
    )
    # Reused without a trial on a fresh model, whose batch it sets as well.
    assert first["again"] == (True, choice, first["batch_size"], size)
    # The LightningCLI config carries the layout and the batch, and trains.
    config = yaml.safe_load(open(first["files"][1]))
    assert config.get("model") == ({"batch_size": size} if replicas > 1 else None)
    assert config["trainer"]["strategy"]["init_args"]["pipeline_size"] == choice.pipeline_size
    assert first["cli"] == first["ran"]


class PlainNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])


class Llama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from tests.hf_models import build

        self.model = build("llama", True, 2)


def test_tensor_parallel_sizes_the_model_has_no_plan_for_are_left_out():
    from lightning_pipe.settings import PipelineSettings
    from lightning_pipe.tune.tuner import planned_tensor_sizes

    space = SearchSpace(pipeline_sizes="auto", tensor_parallel=(1, 2))
    kept, notes = planned_tensor_sizes(PlainNet(), PipelineSettings(), space, 1)
    assert kept.tensor_parallel == (1,)
    assert notes == [
        "tensor_parallel=2 left out: Sequential has no tensor-parallel plan of its own for that size and PlainNet"
        " applies none in `configure_model` (docs/tensor-parallel.md)."
    ]
    pytest.importorskip("transformers")
    kept, notes = planned_tensor_sizes(Llama(), PipelineSettings(), space, 1)
    assert kept.tensor_parallel == (1, 2) and notes == []


def test_a_dataloader_that_ignores_the_batch_size_stops_the_layout_search():
    from lightning_pipe.tune.layout import BatchKnob
    from lightning_pipe.tune.trial import Measurement, TrialResult
    from lightning_pipe.tune.tuner import _check_replica_batch

    knob = BatchKnob(WithHparam(), "model", True, 8)
    trial = TrialResult([Measurement(samples=8), Measurement(samples=8)], warmup=0)
    _check_replica_batch(trial, None, knob)  # the strategy's own data-parallel size: nothing was set
    with pytest.raises(PipelineConfigError, match=r"set `batch_size=2` on the model .* gave batches of \[8\] samples"):
        _check_replica_batch(trial, 2, knob)
    _check_replica_batch(TrialResult([Measurement(samples=2)] * 2, warmup=0), 2, knob)
