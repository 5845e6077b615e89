"""OutcomeChannel: what the last stage sends reaches the other ranks, through every path (2 processes, gloo)."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.step.interception import LoggedValue
from lightning_pipe.step.protocol import Outcome
from lightning_pipe.step.sharing import OutcomeChannel, flatten, rebuild
from tests.launch import run_script


def test_a_group_of_one_returns_what_it_is_given():
    channel = OutcomeChannel(None, src=0, device=torch.device("cpu"))
    outcome = Outcome(loss=torch.tensor(1.0))
    channel.expect()
    assert channel.share(outcome) is outcome and channel.object_steps == 0
    assert not channel.receives  # nothing to post: a step tells it nothing


def test_flatten_and_rebuild_round_trip():
    outcome = Outcome(loss=torch.tensor(1.25), logs=[LoggedValue("a", torch.tensor([2.0]), {"prog_bar": True})])
    schema, values = flatten(outcome)
    flat = torch.cat([torch.as_tensor(v, dtype=torch.float64).reshape(-1) for v in values])
    assert rebuild(schema, flat, torch.device("cpu")) == outcome


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharing")
    run_script("sharing.py", str(out), nprocs=2, launcher="torchrun", timeout=300)
    return [torch.load(out / f"r{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.slow
def test_every_step_arrives(ranks):
    from tests.scripts.sharing import STEPS

    receiver, sender = ranks
    assert receiver["p2p"] and sender["p2p"]
    # only a receiver has a receive to post where the schedule first waits (StepContext.on_receive)
    assert receiver["receives"] and not sender["receives"]
    for (name, sent, _), (got_name, got) in zip(STEPS, receiver["got"]):
        assert got_name == name
        assert got == sent, name
    assert [o for _, o in sender["got"]] == [s[1] for s in STEPS]
    # Object path: the first step, the new log key, the huge integer, the step after it (no known size).
    assert receiver["object_steps"] == sender["object_steps"] == 4


def test_a_tensor_met_twice_travels_once_and_arrives_as_one_object():
    # A training step's output is its loss: one value in the message, one tensor on every rank (as on the sender).
    loss = torch.tensor(0.75)
    outcome = Outcome(loss=loss, output=loss, output_shared=True, key_checksum=3)
    schema, values = flatten(outcome)
    assert len(values) == 2  # the loss once, the checksum
    got = rebuild(schema, torch.tensor([0.75, 3.0], dtype=torch.float64), torch.device("cpu"))
    assert got == outcome and got.output is got.loss
