"""``load_state_dict`` of a whole model's state dict into one rank's stages (``checkpoint/whole_state.py``): each rank
keeps its own entries and reports what one device would report, the same on every rank. The 2-process litgpt loop
with its own strict ``load_checkpoint``: tests/test_fabric.py."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from lightning_pipe.checkpoint.whole_state import keep_own_entries
from lightning_pipe.errors import PipelineCheckpointError
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.split.builder import split_module
from tests.groups import one_rank_group
from tests.models import LitLM, LitTiedLM

CPU = torch.device("cpu")


def _ranks(model):
    """Both ranks' halves of ``model`` (a 2-stage pipeline) with the hook installed; and the uncut model."""
    settings = PipelineSettings(frontend="modules").resolve(2)
    halves = []
    for rank in (0, 1):
        half = copy.deepcopy(model)
        split = split_module(half, settings, pipeline_rank=rank, device=CPU)
        keep_own_entries(split.network, split.state_shapes, split.ties)
        halves.append(half)
    return halves


def _whole(seed: int, tied: bool = False):
    torch.manual_seed(seed)
    return LitTiedLM() if tied else LitLM(n_layers=4)


def test_each_rank_keeps_its_own_entries_of_the_whole_state_dict():
    halves, source = _ranks(_whole(0)), _whole(1).state_dict()
    for half in halves:
        assert half.load_state_dict(source) is not None  # strict: the whole model's keys, no error
    merged = {k: v for half in halves for k, v in half.state_dict().items()}
    assert merged.keys() == source.keys()
    assert all(torch.equal(merged[k], v) for k, v in source.items())
    assert not set(halves[0].state_dict()) & set(halves[1].state_dict()), "each rank holds its own stages"


def test_a_ranks_own_state_dict_loads_as_into_any_module():
    # The strategy's per-rank checkpoint loads (`set_model_state_dict`) give a rank its own entries only.
    for half in _ranks(_whole(0)):
        own = {k: v + 1 for k, v in half.state_dict().items()}
        assert half.load_state_dict(own) is not None
        assert all(torch.equal(half.state_dict()[k], v) for k, v in own.items())
        del own[next(iter(own))]
        with pytest.raises(RuntimeError, match=r"Missing key\(s\)"):
            half.load_state_dict(own)


def test_a_pickled_half_loads_as_any_module():
    # torch.save(model), a network kept in the hyperparameters: the copy is not this rank's run.
    half = pickle.loads(pickle.dumps(_ranks(_whole(0))[0]))
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\)"):
        half.load_state_dict(_whole(1).state_dict())


def test_an_unknown_key_is_unexpected_on_every_rank():
    source = {**_whole(1).state_dict(), "model.layers.9.fc1.weight": torch.zeros(1)}
    for half in _ranks(_whole(0)):
        with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*model\.layers\.9\.fc1\.weight"):
            half.load_state_dict(source)
        assert half.load_state_dict(source, strict=False).unexpected_keys == ["model.layers.9.fc1.weight"]


@pytest.mark.parametrize("absent", ["model.embed.weight", "model.head.bias"])
def test_a_missing_key_is_missing_on_every_rank_whichever_stage_holds_it(absent):
    source = _whole(1).state_dict()
    del source[absent]
    for half in _ranks(_whole(0)):
        with pytest.raises(RuntimeError, match=rf"Missing key\(s\).*{absent}"):
            half.load_state_dict(source)
        assert half.load_state_dict(source, strict=False).missing_keys == [absent]


def test_another_stages_size_mismatch_is_reported_on_every_rank():
    source = {**_whole(1).state_dict(), "model.head.weight": torch.zeros(3, 3)}
    for half in _ranks(_whole(0)):
        with pytest.raises(RuntimeError, match=r"size mismatch for model\.head\.weight.*\[3, 3\].*\[32, 16\]"):
            half.load_state_dict(source, strict=False)


def test_a_tie_across_stages_gets_the_value_one_device_shares():
    # On one device the head's weight IS the embedding's: giving one name sets both (strict=False reports the other).
    source = _whole(1, tied=True).state_dict()
    del source["model.head.weight"]
    halves = _ranks(_whole(0, tied=True))
    for half in halves:
        assert half.load_state_dict(source, strict=False).missing_keys == ["model.head.weight"]
    assert torch.equal(halves[1].model.head.weight, source["model.embed.weight"])
    assert torch.equal(halves[0].model.embed.weight, source["model.embed.weight"])


def test_a_tie_given_two_values_is_refused():
    source = _whole(1, tied=True).state_dict()
    source["model.head.weight"] = source["model.head.weight"] + 1
    for half in _ranks(_whole(0, tied=True)):
        with pytest.raises(
            PipelineCheckpointError, match=r"'model\.embed\.weight', 'model\.head\.weight'.*only 'model\.embed\.weight'"
        ):
            half.load_state_dict(source)


@pytest.fixture
def one_rank():
    """A one-process gloo group (made here if none exists, and removed after): DTensors on a one-rank mesh."""
    with one_rank_group():
        yield


def test_a_dtensor_parameter_gets_its_slice_of_the_whole_tensor(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    half = _ranks(_whole(0))[1]
    head = half.model.head
    head.weight = torch.nn.Parameter(
        distribute_tensor(head.weight.detach(), mesh, [Shard(0)])
    )  # as TP or FSDP leave it
    source = _whole(1).state_dict()
    half.load_state_dict(source)
    assert isinstance(head.weight, DTensor) and head.weight.placements == (Shard(0),)
    assert torch.equal(head.weight.full_tensor(), source["model.head.weight"])
