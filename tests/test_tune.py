"""The tuner's pure parts: candidates, the simulator, the cost model, pruning, the memory limit, the saved choice."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from torch import nn

import lightning_pipe
from lightning_pipe import PipelineConfigError, PipelineParallelStrategy, PipelineUsageError
from lightning_pipe.measure.simulate import StageTimes, schedule_orders, simulate
from lightning_pipe.measure.timeline import theoretical_bubble
from lightning_pipe.models.units import Layout
from lightning_pipe.schedules import export_schedule, load_schedule
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.split.partition import stage_to_rank
from lightning_pipe.tune import prune, record
from lightning_pipe.tune.cost import (
    BalanceRule,
    Calibration,
    Prediction,
    Profile,
    Trial,
    UnitTimes,
    calibrate,
    predict,
    stage_times,
)
from lightning_pipe.tune.profile import network_call, profile_network
from lightning_pipe.tune.space import Candidate, SearchSpace, candidates, from_settings


# ---------------------------------------------------------------------------------------------------- candidates
def test_candidates_respect_batch_blocks_schedules_and_compile():
    space = SearchSpace(compile=(False, True))
    found = candidates(space, pipeline_size=2, batch_size=12, num_blocks=4)
    assert {c.microbatches for c in found} == {2, 3, 4, 6, 12}  # divisors of 12 from 2 up to 4 * 2 * 2
    for c in found:
        assert 12 % c.microbatches == 0
        assert c.stages_per_rank == (1 if c.schedule in ("GPipe", "1F1B") else 2)
        assert not (c.compile and c.schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"))
    # torch's own checks: DualPipeV needs as many microbatches as stages (4); ZBV runs with fewer
    assert min(c.microbatches for c in found if c.schedule == "DualPipeV") == 4
    assert min(c.microbatches for c in found if c.schedule == "ZBVZeroBubble") == 2
    # 3 blocks cannot give 4 stages: only the single-stage schedules remain
    assert {c.schedule for c in candidates(space, 2, 12, 3)} == {"GPipe", "1F1B"}


def test_search_space_values_and_errors():
    space = SearchSpace(schedules=("gpipe", "1f1b", "GPipe"), microbatches=(8, 2, 2), activation_checkpointing=(0, 2))
    assert space.schedules == ("GPipe", "1F1B")
    assert space.microbatches == (2, 8)
    assert space.microbatch_counts(2, 12) == (2,)  # 8 does not divide 12
    assert [c.label for c in candidates(space, 2, 8, 4)] == [
        "GPipe M=2 v=1",
        "GPipe M=2 v=1 +ckpt/2",
        "GPipe M=8 v=1",
        "GPipe M=8 v=1 +ckpt/2",
        "1F1B M=2 v=1",
        "1F1B M=2 v=1 +ckpt/2",
        "1F1B M=8 v=1",
        "1F1B M=8 v=1 +ckpt/2",
    ]
    with pytest.raises(
        PipelineConfigError,
        match=r"`SearchSpace\(schedules=\('auto',\)\)`.*at least one schedule.*'auto'.*Choose among GPipe",
    ):
        SearchSpace(schedules=("auto",))
    with pytest.raises(PipelineConfigError, match="Unknown `schedule='Zero'`"):
        SearchSpace(schedules=("Zero",))
    with pytest.raises(PipelineConfigError, match=r"SearchSpace\(stages_per_rank=\(1,\)\)` must be .* ints >= 2"):
        SearchSpace(stages_per_rank=(1,))
    with pytest.raises(PipelineConfigError, match=r"SearchSpace\(microbatches=\(0,\)\)"):
        SearchSpace(microbatches=(0,))
    with pytest.raises(PipelineConfigError, match=r"SearchSpace\(compile=\(\)\)"):
        SearchSpace(compile=())
    with pytest.raises(PipelineConfigError, match=r"SearchSpace\(activation_checkpointing=\(-1,\)\)"):
        SearchSpace(activation_checkpointing=(-1,))


def test_the_users_settings_as_a_candidate():
    settings = PipelineSettings(schedule="zbvzerobubble", activation_checkpointing=True).resolve(2)
    assert from_settings(settings, 4) == Candidate("ZBVZeroBubble", 4, 2, 1, False)
    assert Candidate("1F1B", 4, 1, 0, True).settings() == {
        "schedule": "1F1B",
        "microbatches": 4,
        "microbatch_size": None,
        "stages_per_rank": 1,
        "activation_checkpointing": 0,
        "compile": True,
    }


# ---------------------------------------------------------------------------------------------------- simulator
@pytest.mark.parametrize(
    "schedule, v, m",
    [("GPipe", 1, 4), ("1F1B", 1, 4), ("1F1B", 1, 8), ("Interleaved1F1B", 2, 8), ("LoopedBFS", 2, 4)],
)
def test_equal_stages_give_the_textbook_bubble(schedule, v, m):
    k = 2
    sim = simulate(
        schedule_orders(schedule, k, m, v), StageTimes.uniform(k * v, 1.0, 1.0, 1.0), stage_to_rank(k * v, k, "loop")
    )
    assert sim.bubble == pytest.approx(theoretical_bubble(k, m, v))
    assert sum(sim.busy) == pytest.approx(k * v * m * 3.0)


def test_zero_bubble_schedules_go_below_the_formula_and_loss_and_imbalance_add_idle_time():
    k, m = 2, 8
    ranks = stage_to_rank(4, k, "v")
    zbv = simulate(schedule_orders("ZBVZeroBubble", k, m, 2), StageTimes.uniform(4, 1.0, 1.0, 1.0), ranks)
    assert zbv.bubble < theoretical_bubble(k, m, 2)
    flat = StageTimes.uniform(2, 1.0, 1.0, 1.0)
    base = simulate(schedule_orders("1F1B", k, m, 1), flat, [0, 1]).bubble
    lossy = StageTimes(flat.forward, flat.backward, flat.backward_input, flat.backward_weight, loss=0.5)
    uneven = StageTimes((1.0, 1.5), (2.0, 3.0), (1.0, 1.5), (1.0, 1.5))
    slow_link = StageTimes(flat.forward, flat.backward, flat.backward_input, flat.backward_weight, transfer=(0.3,))
    for times in (lossy, uneven, slow_link):
        assert simulate(schedule_orders("1F1B", k, m, 1), times, [0, 1]).bubble > base


def test_microbatches_in_flight_and_activation_peaks():
    flat = StageTimes.uniform(2, 1.0, 1.0, 1.0)
    gpipe = simulate(schedule_orders("GPipe", 2, 4, 1), flat, [0, 1])
    one_f_one_b = simulate(schedule_orders("1F1B", 2, 4, 1), flat, [0, 1])
    assert gpipe.in_flight == (4, 4)
    assert one_f_one_b.in_flight == (2, 1)
    assert one_f_one_b.peak_bytes([10.0, 100.0], [0, 1]) == [20.0, 100.0]


def test_schedule_orders_follow_torch_and_refuse_what_torch_refuses():
    assert schedule_orders("1F1B", 2, 4, 1)[1][:3] == [(1, "F", 0), (1, "B", 0), (1, "F", 1)]
    zbv = schedule_orders("ZBVZeroBubble", 2, 4, 2)
    assert {kind for rank in zbv for _, kind, _ in rank} == {"F", "I", "W"}
    assert sorted(a for rank in zbv for a in rank if a[1] == "F") == [(s, "F", i) for s in range(4) for i in range(4)]
    for bad in [("1F1B", 2, 1, 1), ("DualPipeV", 2, 2, 2), ("ZBVZeroBubble", 2, 4, 3), ("GPipe", 2, 4, 2)]:
        with pytest.raises(ValueError):
            schedule_orders(*bad)


# ---------------------------------------------------------------------------------------------------- cost model
def _profile(blocks: int = 4, batch: int = 8) -> Profile:
    """Blocks whose time is proportional to the microbatch size (1 ms per sample forward, 2 ms backward), a cheap
    embedding and a head twice as expensive as a block."""
    layout = Layout(("embed",), tuple(f"layers.{i}" for i in range(blocks)), ("head",))
    times = {}
    for size in (1, 2, 4, 8):
        unit = UnitTimes(1e-3 * size, 2e-3 * size, 1e-3 * size, 1000 * size, 100 * size, 100 * size)
        head = UnitTimes(2e-3 * size, 4e-3 * size, 2e-3 * size, 3000 * size, 100 * size, 900 * size)
        embed = UnitTimes(1e-4 * size, 1e-4 * size, 0.0, 10, 0, 100 * size)
        times[size] = {"embed": embed, "head": head, **{b: unit for b in layout.blocks}}
    params = {u: 1000 for u in layout.units}
    return Profile(layout, params, {u: 4000 for u in layout.units}, times, batch)


def test_prediction_matches_the_flush_formula_for_even_stages():
    profile = _profile()
    rule = BalanceRule("blocks")
    p = predict(Candidate("GPipe", 4, 1), profile, rule, 2, Calibration())
    # blocks [2, 2]: stage 0 = embed + 2 blocks, stage 1 = 2 blocks + head, 2 samples per microbatch
    f = (2e-4 + 4e-3, 4e-3 + 4e-3)
    b = (2e-4 + 8e-3, 8e-3 + 8e-3)
    # GPipe: every forward, then every backward; stage 1 is the bottleneck
    expected = f[0] + 4 * f[1] + 4 * b[1] + b[0]
    assert p.step == pytest.approx(expected)
    assert p.blocks == (2, 2)


def test_activation_checkpointing_costs_a_forward_and_saves_memory():
    profile = _profile()
    rule = BalanceRule("blocks")
    plain = predict(Candidate("GPipe", 4, 1), profile, rule, 2, Calibration())
    ckpt = predict(Candidate("GPipe", 4, 1, 1), profile, rule, 2, Calibration())
    assert ckpt.step > plain.step
    assert all(c < p for c, p in zip(ckpt.memory, plain.memory))
    # GPipe keeps every microbatch's activations: 4 microbatches x 2 blocks x 2000 saved bytes on rank 0, plus the
    # embedding's, plus parameters, gradients and (SGD) nothing more
    assert plain.memory[0] == pytest.approx(4 * (2 * 2000 + 10) + 3 * 4000 * 2)


def test_balance_rules_give_the_strategys_splits():
    profile = _profile(blocks=6)
    auto = predict(Candidate("1F1B", 4, 1), profile, BalanceRule("auto", has_example=True), 2, Calibration())
    assert auto.blocks == (4, 2)  # the head costs two blocks: stage 1 gets fewer blocks
    even = predict(Candidate("1F1B", 4, 1), profile, BalanceRule("blocks"), 2, Calibration())
    assert even.blocks == (3, 3)
    listed = predict(Candidate("1F1B", 4, 1), profile, BalanceRule((5, 1)), 2, Calibration())
    assert listed.blocks == (5, 1)
    points = BalanceRule(split_points=("layers.2",))
    assert predict(Candidate("1F1B", 4, 1), profile, points, 2, Calibration()).blocks == (2, 4)
    assert auto.step < even.step


def test_calibration_reproduces_the_measured_trials():
    profile = _profile()
    rule = BalanceRule("blocks")
    first = Candidate("1F1B", 4, 1)
    raw = predict(first, profile, rule, 2, Calibration())
    actions = {(0, "F"): 0.0043, (1, "F"): 0.0091, (0, "B"): 0.0083, (1, "B"): 0.0161, (1, "L"): 0.004}
    # (the step beyond the loss's 4 x 4 ms that the raw span leaves out)
    trials = [Trial(first, raw.span + 0.03, (raw.memory[0] + 5e6, raw.memory[1] + 5e6), actions, 1.0)]
    calibration = calibrate(profile, rule, 2, trials, transfer=(1e-4, 1e-9))
    assert calibration.action_overhead == pytest.approx(1e-4, abs=2e-5)
    assert calibration.loss_per_sample == pytest.approx(0.002)
    assert calibration.latency == 1e-4
    again = predict(first, profile, rule, 2, calibration)
    assert again.step == pytest.approx(trials[0].step)
    assert again.peak == pytest.approx(max(trials[0].memory))
    # More microbatches cost more actions: with an overhead per action, M=8 gains less over M=4 than without it
    more = predict(Candidate("1F1B", 8, 1), profile, rule, 2, calibration)
    assert more.step - again.step > predict(Candidate("1F1B", 8, 1), profile, rule, 2, Calibration()).step - raw.step


def test_a_compute_sized_gap_is_a_factor_not_a_per_action_cost_and_the_step_overhead_is_never_negative():
    profile = _profile()
    rule = BalanceRule("blocks")
    first = Candidate("1F1B", 4, 1)
    modelled = {(0, "F"): 4.2e-3, (1, "F"): 8e-3, (0, "B"): 8.1e-3, (1, "B"): 16e-3}
    # Every backward 1.5 times the profile's and every action 1e-4 s more: the gap grows with the compute.
    actions = {k: (v * 1.5 if kind == "B" else v) + 1e-4 for (k, v), kind in zip(modelled.items(), "FFBB")}
    actions = {**actions, (1, "L"): 4e-3}
    calibration = calibrate(profile, rule, 2, [Trial(first, 1.0, (), actions)])
    assert calibration.action_overhead == pytest.approx(1e-4, rel=0.05)
    assert calibration.compute_scale == (pytest.approx(1.0, abs=0.02), pytest.approx(1.5, abs=0.02))
    # The trial's own actions are reproduced: the factor times the profile, plus the overhead.
    times, _, _ = stage_times(first, profile, [2, 2], calibration)
    assert times.backward[1] + calibration.action_overhead == pytest.approx(actions[(1, "B")], rel=0.02)
    assert times.forward[0] + calibration.action_overhead == pytest.approx(actions[(0, "F")], rel=0.02)
    # A trial measured faster than its modelled schedule: no negative overhead, no negative prediction.
    fast = calibrate(profile, rule, 2, [Trial(first, 1e-4)])
    assert fast.step_overhead == 0.0 and predict(first, profile, rule, 2, fast).step > 0


def test_compile_factor_is_learned_from_a_compiled_trial_and_its_eager_twin():
    profile = _profile()
    rule = BalanceRule("blocks")
    eager, compiled = Candidate("1F1B", 4, 1), Candidate("1F1B", 4, 1, 0, True)
    trials = [Trial(eager, 0.1), Trial(compiled, 0.08)]
    calibration = calibrate(profile, rule, 2, trials)
    assert calibration.compile_factor == pytest.approx(0.8)
    assert predict(compiled, profile, rule, 2, calibration).step == pytest.approx(
        0.8 * predict(eager, profile, rule, 2, calibration).step
    )


# ---------------------------------------------------------------------------------------------------- pruning
def _prediction(step: float, peak: float = 1.0) -> Prediction:
    return Prediction(step, 0.0, (peak,))


def test_next_trial_memory_limit_margin_and_eager_before_compiled():
    a, b, c, d = (Candidate("1F1B", m, 1) for m in (2, 4, 8, 16))
    b_compiled = Candidate("1F1B", 4, 1, 0, True)
    predictions = {a: _prediction(1.0), b: _prediction(0.8), b_compiled: _prediction(0.8), c: _prediction(0.7, 50)}
    predictions[d] = _prediction(1.2)
    measured = {a: prune.Measured(1.0, 1.0, 1.0)}
    assert prune.next_trial(predictions, measured, None, 0.1) == c
    assert prune.next_trial(predictions, measured, 10, 0.1) == b  # c is predicted over the limit
    measured[b] = prune.Measured(0.8, 0.8, 1.0)
    assert prune.next_trial(predictions, measured, 10, 0.1) == b_compiled
    measured[b_compiled] = prune.Measured(0.9, 0.8, 1.0)
    # d is predicted 50% slower than b, the best measured: not worth a trial (with a margin of 10%)
    assert prune.next_trial(predictions, measured, 10, 0.1) is None
    assert prune.next_trial(predictions, measured, 10, 0.6) == d


def test_predictions_are_corrected_by_what_their_group_measured():
    a2, b2, a2v = Candidate("1F1B", 2, 1), Candidate("GPipe", 2, 1), Candidate("Interleaved1F1B", 2, 2)
    a4, a2c = Candidate("1F1B", 4, 1), Candidate("1F1B", 2, 1, 0, True)
    predictions = {c: _prediction(1.0) for c in (a2, b2, a2v, a4, a2c)}
    predictions[b2] = _prediction(2.0)
    measured = {a2: prune.Measured(1.3, 1.0, 1.0)}
    fixed = prune.corrected(predictions, measured)
    # Same microbatches and stages per rank (eager): scaled by 1.3; any other group as the model said.
    assert fixed[a2].step == pytest.approx(1.3) and fixed[b2].step == pytest.approx(2.6)
    assert fixed[a2v].step == fixed[a4].step == fixed[a2c].step == 1.0
    assert fixed[b2].peak == predictions[b2].peak
    # Two measurements in a group: the median ratio.
    measured[b2] = prune.Measured(2.2, 1.0, 1.0)  # ratio 1.1
    measured[Candidate("ZBVZeroBubble", 2, 1)] = prune.Measured(9.9, 1.0, 1.0)  # not predicted: no ratio
    assert prune.corrected(predictions, measured)[b2].step == pytest.approx(2.0 * 1.2)


def test_next_trial_takes_an_unmeasured_group_first():
    a2, b2, a4 = Candidate("1F1B", 2, 1), Candidate("GPipe", 2, 1), Candidate("1F1B", 4, 1)
    predictions = {
        a2: _prediction(1.0),
        b2: _prediction(1.0),
        a4: _prediction(1.05),
        Candidate("GPipe", 8, 1): _prediction(2),
    }
    measured = {a2: prune.Measured(1.0, 1.0, 1.0)}
    # b2 is predicted faster than a4, but a4's group has no measurement yet: one trial there corrects all of it.
    assert prune.next_trial(predictions, measured, None, 0.1) == a4
    measured[a4] = prune.Measured(0.95, 1.0, 1.0)
    assert prune.next_trial(predictions, measured, None, 0.1) == b2
    measured[b2] = prune.Measured(1.06, 1.0, 1.0)
    assert prune.next_trial(predictions, measured, None, 0.1) is None  # M=8 is predicted twice as slow
    # A group not measured yet gets twice the margin: its prediction is not corrected.
    wide = {**predictions, Candidate("GPipe", 16, 1): _prediction(1.25)}
    assert prune.next_trial(wide, measured, None, 0.1) == Candidate("GPipe", 16, 1)  # 1.25 <= 1.05 (a4's) * 1.2
    wide[Candidate("GPipe", 16, 1)] = _prediction(1.3)
    assert prune.next_trial(wide, measured, None, 0.1) is None


def test_rows_tell_budget_from_prediction():
    a, b, c = Candidate("1F1B", 2, 1), Candidate("GPipe", 4, 1), Candidate("GPipe", 8, 1)
    predictions = {a: _prediction(1.0), b: _prediction(1.05), c: _prediction(1.5)}
    measured = {a: prune.Measured(1.0, 1.0, 1.0, 10, 2)}
    rows = {r.candidate: r.status for r in prune.rows(predictions, measured, a, None, 0.1)}
    assert rows == {a: prune.CHOSEN, b: prune.UNTRIED, c: prune.SLOWER}
    assert prune.table(prune.rows(predictions, measured, a, None, 0.1)).count("(2 trials)") == 1


def test_choice_within_the_memory_limit_and_the_table():
    a, b, c = Candidate("1F1B", 2, 1), Candidate("GPipe", 4, 1), Candidate("GPipe", 8, 1, 1)
    predictions = {a: _prediction(1.0, 5), b: _prediction(0.5, 5), c: _prediction(0.7, 500)}
    measured = {a: prune.Measured(1.0, 0.9, 5.0), b: prune.Measured(0.4, 0.4, 50.0)}
    assert prune.choose(measured, None) == b
    assert prune.choose(measured, 10) == a  # b measured over the limit
    assert prune.choose(measured, 1) is None
    rows = prune.rows(predictions, measured, a, 10)
    assert [(r.candidate, r.status) for r in rows] == [
        (b, prune.OVER_MEMORY_MEASURED),
        (a, prune.CHOSEN),
        (c, prune.OVER_MEMORY),
    ]
    text = prune.table(rows, limit=2)
    assert "1F1B M=2 v=1" in text and "chosen" in text and "1000.0" in text
    assert "... and 1 more: 1 over the memory limit (predicted)" in text


# ---------------------------------------------------------------------------------------------------- the record
def test_record_round_trip_fingerprint_and_cli_config(tmp_path):
    choice = Candidate("ZBVZeroBubble", 8, 2, 1)
    facts = {"model": "M", "parameters": 10, "devices": 2}
    fp = record.fingerprint(facts)
    assert fp == record.fingerprint(dict(reversed(list(facts.items()))))
    assert fp != record.fingerprint({**facts, "devices": 4})
    saved = record.TuneRecord(fp, choice, facts, "table", {"wall_s": 1.0}, choice.settings())
    json_file, yaml_file = record.save(saved, tmp_path / "tuned")
    assert (json_file.name, yaml_file.name) == ("tuned.json", "tuned.yaml")
    assert record.load(tmp_path / "tuned.yaml", fp) == saved
    assert record.load(tmp_path / "tuned", record.fingerprint({**facts, "devices": 4})) is None
    assert record.load(tmp_path / "missing", fp) is None
    (tmp_path / "bad.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(PipelineConfigError, match="is not a lightning-pipe tuning record"):
        record.load(tmp_path / "bad", fp)


def test_the_cli_config_parses_into_the_strategy(tmp_path):
    from jsonargparse import ArgumentParser

    choice = Candidate("Interleaved1F1B", 8, 2, 1)
    _, yaml_file = record.save(record.TuneRecord("x", choice, settings=choice.settings()), tmp_path / "t")
    parser = ArgumentParser()
    parser.add_argument("--trainer.strategy", type=PipelineParallelStrategy)
    parser.add_argument("--config", action="config")
    base = tmp_path / "base.yaml"
    base.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_pipe.PipelineParallelStrategy\n    init_args:\n"
        "      schedule: 1F1B\n      balance: blocks\n"
    )
    config = parser.parse_args(["--config", str(base), "--config", str(yaml_file)])
    strategy = parser.instantiate_classes(config)["trainer.strategy"]
    assert strategy.settings.schedule == "Interleaved1F1B"
    assert strategy.settings.microbatches == 8
    assert strategy.settings.activation_checkpointing == 1
    assert strategy.settings.balance == "blocks"  # the first config's other arguments stay


# ---------------------------------------------------------------------------------------------------- tune()
class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


def test_tune_refuses_other_strategies_split_models_and_bad_budgets(tmp_path):
    with pytest.raises(PipelineConfigError, match="the Trainer's strategy is SingleDeviceStrategy"):
        lightning_pipe.tune(L.Trainer(accelerator="cpu", devices=1, logger=False), Tiny())
    trainer = L.Trainer(strategy="pipeline", accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)
    model = Tiny()
    model.__dict__["_lightning_pipe_split"] = object()
    with pytest.raises(
        PipelineUsageError, match=r"already split by.*fit.*`tune` needs the whole model.*before `trainer\.fit`"
    ):
        lightning_pipe.tune(trainer, model)
    for kwargs, message in [
        ({"steps": 0}, r"`tune\(steps=0\)` must be an int >= 1"),
        ({"max_trials": 1.5}, r"`tune\(max_trials=1.5\)`"),
        ({"confirm": -1}, r"`tune\(confirm=-1\)` must be an int >= 0"),
        ({"margin": -1}, r"`tune\(margin=-1\)`"),
        ({"memory_limit": 0}, r"`tune\(memory_limit=0\)`"),
    ]:
        with pytest.raises(PipelineConfigError, match=message):
            lightning_pipe.tune(trainer, Tiny(), **kwargs)


def test_tune_reuses_a_matching_record_without_a_trial(tmp_path):
    trainer = L.Trainer(strategy="pipeline", accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)
    model = Tiny()
    from lightning_pipe.tune.tuner import _facts

    facts = _facts(trainer, model, None, SearchSpace(), None)
    choice = Candidate("GPipe", 4, 1, 1)
    record.save(
        record.TuneRecord(record.fingerprint(facts), choice, settings=choice.settings()), tmp_path / "pipeline_tune"
    )
    result = lightning_pipe.tune(trainer, model)  # would start a trial (and fail: one device) if it did not reuse
    assert result.reused and result.choice == choice
    assert trainer.strategy.settings.schedule == "GPipe"
    assert trainer.strategy.settings.microbatches == 4
    assert trainer.strategy.settings.activation_checkpointing == 1


def test_a_trial_frees_its_trainer_and_model_copy_before_the_next_one(tmp_path):
    import gc
    import weakref

    from lightning_pipe.tune.trial import TrialSetup, run_trial
    from tests.models import LitLM, quiet_trainer

    alive: weakref.WeakSet = weakref.WeakSet()

    class Tracked(LitLM):
        def setup(self, stage: str) -> None:
            alive.add(self)

    trainer = quiet_trainer(strategy="pipeline", devices=1, default_root_dir=str(tmp_path))
    enabled = gc.isenabled()
    gc.disable()  # the collector's own timing must not decide this
    try:
        result = run_trial(TrialSetup.of(trainer), PipelineParallelStrategy, Tracked(n_layers=2), {}, 2, 1, False)
        assert len(alive) == 0  # the trial's copy of the model (and its Trainer) are gone: its peak was its own
    finally:
        if enabled:
            gc.enable()
    assert len(result.step_seconds()) == 2


def test_ranks_that_share_cores_on_one_host():
    from lightning_pipe.tune.trial import placement, shared_cores, shared_cores_note

    a, b = frozenset({0}), frozenset({1})
    assert shared_cores([("h", a), ("h", b)]) == []  # pinned apart
    assert shared_cores([("h", a | b), ("h", b)]) == [(0, 1)]
    assert shared_cores([("h", a), ("g", a)]) == []  # other hosts
    assert shared_cores([("h", frozenset()), ("h", frozenset()), None]) == []  # the OS did not say
    everywhere = [("h", a | b)] * 5
    assert len(shared_cores(everywhere)) == 10
    note = shared_cores_note(shared_cores(everywhere))
    assert "ranks 0 and 1, 0 and 2, 0 and 3 (and 7 more pairs) may run on the same CPU cores" in note
    assert "os.sched_setaffinity" in note and "retune=True" in note
    host, cores = placement()
    assert host and (cores or not hasattr(os, "sched_getaffinity"))


def test_apply_tuned_only_before_the_trainer_starts():
    strategy = PipelineParallelStrategy()
    strategy.apply_tuned(schedule="GPipe", microbatches=2)
    assert (strategy.settings.schedule, strategy.settings.microbatches) == ("GPipe", 2)
    with pytest.raises(PipelineConfigError, match="`compile` cannot be used with"):
        strategy.apply_tuned(schedule="ZBVZeroBubble", compile=True)
    strategy._session._settings = strategy.settings.resolve(2)  # as the processes starting resolves them
    with pytest.raises(PipelineUsageError, match="tune before `trainer.fit`"):
        strategy.apply_tuned(schedule="1F1B")


# ---------------------------------------------------------------------------------------------------- profiling
def test_profile_takes_the_network_call_from_the_users_step():
    model = Tiny()
    batch = (torch.randn(8, 4), torch.randn(8, 4))
    args, kwargs = network_call(model, model.net, (batch[0][:2], batch[1][:2]))
    assert args[0].shape == (2, 4) and kwargs == {}
    profile = profile_network(model, PipelineSettings(), batch, [2, 4], torch.device("cpu"), repeats=1)
    assert profile.layout.blocks == ("0", "1", "2", "3")
    assert sorted(profile.times) == [2, 4]
    unit = profile.times[4]["1"]
    assert unit.forward > 0 and unit.backward > 0 and unit.backward_input > 0
    assert unit.input_bytes == 4 * 4 * 4 and unit.output_bytes == 4 * 4 * 4
    assert profile.params["0"] == 20


def test_profile_names_a_step_that_needs_a_trainer():
    class NeedsTrainer(Tiny):
        def training_step(self, batch, batch_idx):
            self.trainer.global_step  # noqa: B018 - raises outside a Trainer
            return super().training_step(batch, batch_idx)

    model = NeedsTrainer()
    with pytest.raises(lightning_pipe.PipelineModelError, match="Set `self.example_input_array`"):
        network_call(model, model.net, (torch.randn(2, 4), torch.randn(2, 4)))
    model.example_input_array = torch.randn(8, 4)
    args, _ = network_call(model, model.net, (torch.randn(2, 4), torch.randn(2, 4)))
    assert args[0].shape == (2, 4)


# ------------------------------------------------------------------------------------------ schedules of one's own
def _exported(tmp_path: Path, schedule: str = "1F1B", pipeline_size: int = 2, microbatches: int = 4, v: int = 1):
    path = tmp_path / f"{schedule}.csv"
    return path, export_schedule(schedule, pipeline_size, microbatches, path, v)


def test_a_schedule_of_ones_own_fixes_its_counts_and_varies_the_rest(tmp_path):
    path, _ = _exported(tmp_path)
    space = SearchSpace(schedules=("gpipe", str(path)), microbatches=(2, 8), compile=(False, True))
    custom = space.schedules[1]
    assert space.schedules[0] == "GPipe" and custom == load_schedule(path)
    found = [c for c in candidates(space, pipeline_size=2, batch_size=8, num_blocks=4) if c.schedule == custom]
    # its own 4 microbatches and one stage per rank (not the space's (2, 8)); checkpointing and compile vary
    assert [c.label for c in found] == [
        "1F1B.csv M=4 v=1",
        "1F1B.csv M=4 v=1 +compile",
        "1F1B.csv M=4 v=1 +ckpt",
        "1F1B.csv M=4 v=1 +ckpt +compile",
    ]
    assert found[2].settings() == {
        "schedule": str(path),
        "microbatches": 4,
        "microbatch_size": None,
        "stages_per_rank": 1,
        "activation_checkpointing": 1,
        "compile": False,
    }
    # another pipeline size, a batch its microbatches do not divide, fewer blocks than stages: not a candidate
    for shape in [(4, 8, 4), (2, 6, 4), (2, 8, 1)]:
        assert all(c.schedule != custom for c in candidates(space, *shape))
    # its microbatch count is profiled; a space of schedules of one's own profiles only theirs
    assert space.counts_to_profile(2, 8) == {2, 4, 8}
    assert SearchSpace(schedules=(custom,)).counts_to_profile(2, 8) == {4}
    # names before schedules of one's own when predictions tie
    assert sorted(candidates(space, 2, 8, 4))[0].schedule == "GPipe"


def test_a_schedule_of_ones_own_that_splits_the_backward_is_not_compiled(tmp_path):
    _, zbv = _exported(tmp_path, "ZBVZeroBubble", 2, 4, 2)
    found = candidates(SearchSpace(schedules=(zbv,), compile=(False, True)), 2, 8, 4)
    assert {(c.stages_per_rank, c.microbatches, c.compile) for c in found} == {(2, 4, False)}
    assert [c.label for c in found] == ["custom M=4 v=2", "custom M=4 v=2 +ckpt"]  # exported, not read from a CSV
    assert found[0].settings()["schedule"] == zbv.texts()


@pytest.mark.parametrize("schedule, v", [("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)])
def test_a_schedule_of_ones_own_is_predicted_from_its_actions(tmp_path, schedule, v):
    _, custom = _exported(tmp_path, schedule, 2, 4, v)
    profile, rule, calibration = _profile(), BalanceRule("blocks"), Calibration(latency=1e-4, action_overhead=1e-5)
    for every in (0, 1):
        own = predict(Candidate(custom, 4, v, every), profile, rule, 2, calibration)
        assert own == predict(Candidate(schedule, 4, v, every), profile, rule, 2, calibration)
    # the given order, not the name's: GPipe's order exported and relabelled as one's own predicts as GPipe
    _, gpipe = _exported(tmp_path, "GPipe", 2, 4)
    gpipe_own = predict(Candidate(gpipe, 4, 1), profile, rule, 2, calibration)
    assert gpipe_own == predict(Candidate("GPipe", 4, 1), profile, rule, 2, calibration)
    assert gpipe_own.peak > predict(Candidate("1F1B", 4, 1), profile, rule, 2, calibration).peak


def test_a_schedule_of_ones_own_is_recorded_by_its_csv_and_the_config_reproduces_it(tmp_path):
    from jsonargparse import ArgumentParser

    path, _ = _exported(tmp_path)
    choice = Candidate(load_schedule(path), 4, 1, 1)
    saved = record.TuneRecord("fp", choice, {}, "table", {}, choice.settings())
    json_file, yaml_file = record.save(saved, tmp_path / "t")
    assert json.loads(json_file.read_text())["choice"]["schedule"] == str(path)
    assert record.load(tmp_path / "t", "fp") == saved
    parser = ArgumentParser()
    parser.add_argument("--trainer.strategy", type=PipelineParallelStrategy)
    parser.add_argument("--config", action="config")
    strategy = parser.instantiate_classes(parser.parse_args(["--config", str(yaml_file)]))["trainer.strategy"]
    assert strategy.settings.schedule == choice.schedule
    assert (strategy.settings.microbatches, strategy.settings.activation_checkpointing) == (4, 1)
    # given as lists, the record and the config hold the lists
    lists = Candidate(load_schedule(choice.schedule.texts()), 4, 1)
    record.save(record.TuneRecord("fp2", lists, settings=lists.settings()), tmp_path / "l")
    assert record.load(tmp_path / "l", "fp2").choice == lists


def test_tune_keeps_the_strategys_own_schedule_and_tunes_the_rest(tmp_path):
    from lightning_pipe.tune.tuner import _facts

    path, _ = _exported(tmp_path)
    strategy = PipelineParallelStrategy(schedule=str(path))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)
    model = Tiny()
    own = strategy.settings.schedule
    # what tune searches: the strategy's schedule only, whatever the space names
    facts = _facts(trainer, model, None, SearchSpace(schedules=(own,)), None)
    choice = Candidate(own, 4, 1, 1)
    record.save(
        record.TuneRecord(record.fingerprint(facts), choice, settings=choice.settings()), tmp_path / "pipeline_tune"
    )
    result = lightning_pipe.tune(trainer, model)  # would start a trial (and fail: one device) if it did not reuse
    assert result.reused and result.choice == choice
    assert trainer.strategy.settings.schedule == own
    assert trainer.strategy.settings.activation_checkpointing == 1


# ---------------------------------------------------------------------------------------------------- 2 processes
@pytest.mark.extended
@pytest.mark.slow
def test_tune_at_two_processes(tmp_path):
    import yaml

    from tests.launch import run_script

    proc = run_script("tune.py", str(tmp_path), nprocs=2, launcher="lightning", timeout=900)
    ranks = [torch.load(tmp_path / f"tune.rank{r}.pt", weights_only=False) for r in range(2)]
    first, second = ranks
    # Every rank took the same decisions from the same (agreed) measurements.
    for key in ("choice", "settings", "rows", "cost", "again", "limited", "own", "sureness"):
        assert first[key] == second[key], key
    choice = first["choice"]
    statuses = [status for _, status, _ in first["rows"]]
    assert statuses.count(prune.CHOSEN) == 1
    measured = [trials for _, _, trials in first["rows"] if trials]
    assert 2 <= len(measured) <= 3 and first["cost"]["measured"] == len(measured)  # max_trials
    # Candidates within the measured noise of the fastest are measured again with it: one round of `confirm` = 2.
    assert set(measured) <= {1, 2} and first["cost"]["trials"] == sum(measured)
    assert first["cost"]["repeated"] in (0, 2) and first["cost"]["trials"] == len(measured) + first["cost"]["repeated"]
    sure = first["sureness"]
    assert 0 <= sure["probability"] <= 1 and sure["interval"][0] <= sure["ratio"] <= sure["interval"][1]
    assert json.loads(Path(first["files"][0]).read_text())["sureness"] == sure
    assert first["cost"]["steps"] == first["cost"]["trials"] * 3
    assert first["cost"]["wall_s"] > first["cost"]["launch_s"] > 0 and first["cost"]["in_steps"] > 0
    # The table on rank 0's output, once.
    # tuned, reused, then the strategy's own schedule tuned
    assert proc.stdout.count("Pipeline tuning:") + proc.stderr.count("Pipeline tuning:") == 3
    assert choice.label in first["table"]
    # Applied, and the fit ran with it; the user's model and random state untouched by the trials.
    assert first["ran"] == (choice.schedule, choice.microbatches)
    assert first["rng_kept"] and first["untouched"]
    # The record and the LightningCLI config on disk; a second tune reuses them without a trial.
    json_file, yaml_file = map(Path, first["files"])
    assert json.loads(json_file.read_text())["choice"]["schedule"] == choice.schedule
    init_args = yaml.safe_load(yaml_file.read_text())["trainer"]["strategy"]["init_args"]
    assert init_args == choice.settings()
    assert first["again"] == (True, choice, first["settings"])
    # Lightning's launcher leaves both processes free to run on every core: the tuner says so, and how to fix it.
    assert len(first["notes"]) == 1 and "ranks 0 and 1 may run on the same CPU cores" in first["notes"][0]
    assert (proc.stdout + proc.stderr).count("Note: Processes of ranks 0 and 1") == 2  # both tunings that measured
    # A memory limit nothing fits: a clear error on every rank.
    assert "No measured setting stayed within `memory_limit` (1.00 KiB per process)" in first["limited"]
    # A strategy given a schedule of its own: its two checkpointing candidates both ran it; the config names its CSV.
    rows, settings = first["own"]
    csv = str(tmp_path / "1f1b.csv")
    assert sorted(rows) == [("1f1b.csv M=4 v=1", csv, True), ("1f1b.csv M=4 v=1 +ckpt", csv, True)]
    assert settings["schedule"] == csv and settings["microbatches"] == 4
    assert yaml.safe_load(first["own_config"])["trainer"]["strategy"]["init_args"] == settings


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to pin to"
)
def test_the_documented_pinning_gives_each_rank_its_own_cores_and_silences_the_note(tmp_path):
    from tests.launch import run_script

    proc = run_script("tune_pinned.py", str(tmp_path), nprocs=2, launcher="lightning", timeout=600)
    ranks = [torch.load(tmp_path / f"pinned.rank{r}.pt", weights_only=False) for r in range(2)]
    allowed = sorted(os.sched_getaffinity(0))
    half = len(allowed) // 2
    for rank, seen in enumerate(ranks):
        assert seen["notes"] == ()
        # Every thread (torch's, gloo's, Lightning's) inherited the pin of its process.
        assert len(seen["threads"]) > 2 and all(
            t == set(allowed[rank * half : (rank + 1) * half]) for t in seen["threads"]
        )
    assert "Note: Processes of ranks" not in proc.stdout + proc.stderr
