"""The tuner's choice between measured candidates under noise (lightning_pipe/tune/noise.py, prune.repeat_round):
injected timings, no process group."""

from __future__ import annotations

import math

import pytest

from lightning_pipe.tune import noise, prune
from lightning_pipe.tune.noise import Runs, contenders, step_jitter, sureness, trial_noise
from lightning_pipe.tune.space import Candidate

A, B, C = Candidate("GPipe", 2, 1), Candidate("ZBVZeroBubble", 2, 2), Candidate("1F1B", 4, 1)


def _measured(*medians: float, jitter: float = 0.0, steps: int = 5, peak: float = 1.0) -> prune.Measured:
    estimate = math.exp(sum(math.log(m) for m in medians) / len(medians))
    return prune.Measured(estimate, 0.0, peak, steps * len(medians), len(medians), medians, (jitter,) * len(medians))


def test_step_jitter_is_the_spread_of_the_logarithms():
    assert step_jitter([0.1]) == 0.0
    assert step_jitter([0.1, 0.1, 0.1]) == 0.0
    assert step_jitter([1.0, math.e]) == pytest.approx(math.sqrt(0.5))


def test_trial_noise_pools_repeated_candidates_and_falls_back_to_the_steps_spread():
    once = {A: Runs((0.10,), (0.2,), 5), B: Runs((0.12,), (0.1,), 5)}
    assert trial_noise(once) == pytest.approx(0.15)  # no repeats: the median step spread
    logs_a, logs_b = (math.log(0.10), math.log(0.11)), (math.log(0.12), math.log(0.12))
    pooled = math.sqrt(
        (sum((x - sum(logs_a) / 2) ** 2 for x in logs_a) + sum((x - sum(logs_b) / 2) ** 2 for x in logs_b)) / 2
    )
    twice = {A: Runs((0.10, 0.11), (0.0, 0.0), 100), B: Runs((0.12, 0.12), (0.0, 0.0), 100)}
    assert trial_noise(twice) == pytest.approx(pooled)
    # Never below what the steps' spread allows for a median of that many steps.
    steady = {A: Runs((0.1, 0.1), (0.4, 0.4), 4), B: Runs((0.2, 0.2), (0.4, 0.4), 4)}
    assert trial_noise(steady) == pytest.approx(1.25 * 0.4 / 2)


def test_a_candidate_within_the_noise_is_measured_again_with_the_leader():
    # The case: one short trial put GPipe (93 ms in truth) at 0.90 of ZBV on a busy machine (20% step spread).
    measured = {A: _measured(0.090, jitter=0.2), B: _measured(0.093, jitter=0.2), C: _measured(0.300, jitter=0.2)}
    assert prune.repeat_round(measured, None, 6) == [A, B]  # C is far outside the noise
    assert prune.repeat_round(measured, None, 1) == []  # no room for a pair
    assert prune.repeat_round(measured, None, 0) == []
    # Over the memory limit: neither leader nor contender.
    limited = {**measured, B: _measured(0.093, jitter=0.2, peak=50)}
    assert prune.repeat_round(limited, 10, 6) == []


def test_repeats_stop_once_the_leader_stands_out():
    # Interleaved repeats measured B faster every time, with little trial-to-trial noise: B leads, A is outside.
    measured = {A: _measured(0.100, 0.124, 0.122, jitter=0.1), B: _measured(0.093, 0.094, 0.092, jitter=0.1)}
    assert prune.choose(measured, None) == B
    assert prune.repeat_round(measured, None, 6) == []
    sure = prune.how_sure(measured, None, B)
    assert sure.rival == A and not sure.within_noise and sure.probability > 0.975
    assert sure.low > 1.0 and sure.low < sure.ratio < sure.high
    assert sure.ratio == pytest.approx(measured[A].step / measured[B].step)


def test_contenders_are_the_closest_first_and_at_most_count():
    runs = {A: Runs((0.100,), (0.3,)), B: Runs((0.130,), (0.3,)), C: Runs((0.105,), (0.3,))}
    assert contenders(runs, A, 5) == [C, B]
    assert contenders(runs, A, 1) == [C]
    exact = {A: Runs((0.1,)), B: Runs((0.1000001,))}  # no noise measured at all: nothing is within it but a tie
    assert contenders(exact, A, 3) == []


def test_sureness_of_a_close_pair_is_near_a_coin_toss_and_says_so():
    runs = {A: Runs((0.100,), (0.3,)), B: Runs((0.101,), (0.3,))}
    sure = sureness(runs, A)
    assert sure.rival == B and sure.within_noise
    assert 0.5 < sure.probability < 0.6 and sure.low < 1.0 < sure.high
    text = sure.describe()
    assert "ZBVZeroBubble M=2 v=2" in text and "1.010" in text and "within the noise" in text
    assert sure.as_dict()["rival"] == B.label and sure.as_dict()["interval"] == [sure.low, sure.high]
    alone = sureness({A: Runs((0.1,))}, A)
    assert alone.rival is None and alone.probability == 1.0 and "no other candidate" in alone.describe()
    assert noise.Z95 == pytest.approx(1.96, abs=1e-3)
