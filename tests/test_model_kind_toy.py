"""A model kind added from outside ``lightning_pipe/models/`` (tests/toy_kind.py: its own unit finder, its own
on-disk format) goes through the split, ``init_weights``, checkpoints, resume and ``export-hf`` with nothing in the
package knowing it: ``register_kind`` and the kind's files (``StateDictAdapter``) are all it takes."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_pipe import PipelineCheckpointError
from lightning_pipe.checkpoint import export, io
from lightning_pipe.checkpoint import format as fmt
from lightning_pipe.models import files_named, files_reading, kind_of, register_kind, restore_buffers
from lightning_pipe.models.plain import PlainKind
from tests.launch import run_script
from tests.toy_kind import ToyFiles, ToyKind, ToyNet, claim, disk_name, load_toy, register, save_toy


# ---------------------------------------------------------------------------------------------------- one process
def test_a_registered_kind_claims_its_networks_until_removed(tmp_path):
    save_toy(ToyNet().state_dict(), tmp_path / "toy")
    assert isinstance(kind_of(ToyNet()), PlainKind) and files_reading(tmp_path / "toy") is None
    with register():
        assert isinstance(kind_of(ToyNet()), ToyKind) and not isinstance(kind_of(torch.nn.Linear(2, 2)), ToyKind)
        assert isinstance(files_reading(tmp_path / "toy"), ToyFiles) and isinstance(files_named("toy"), ToyFiles)
        assert io.pretrained_files(tmp_path / "toy").title == "toy model directory"
    assert isinstance(kind_of(ToyNet()), PlainKind) and files_named("toy") is None


def test_the_latest_registration_is_tried_first():
    class Other(ToyKind):
        name = "other"

    with register(), register_kind(lambda network: Other() if isinstance(network, ToyNet) else None):
        assert kind_of(ToyNet()).name == "other"
    registration = register_kind(claim)
    registration.remove()
    registration.remove()  # again: nothing
    assert isinstance(kind_of(ToyNet()), PlainKind)


def test_its_own_units():
    net = ToyNet()
    with register():
        layout = kind_of(net).layout(net)
    assert layout.pre == ("inp",) and layout.blocks == ("cells.a", "cells.b", "cells.c", "cells.d")
    assert layout.post == ("out",)


def test_its_submodule_hook_restores_what_the_meta_device_lost():
    with torch.device("meta"):
        net = ToyNet()
    net.to_empty(device="cpu")
    cell = net.cells["c"]
    assert not restore_buffers(cell)
    with register():
        assert restore_buffers(cell) and torch.equal(cell.scale, torch.full_like(cell.scale, 1 / 3))
        assert not restore_buffers(net.inp)


def test_export_of_a_format_no_kind_exports_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "checkpoint_entries", lambda src: _entries(src, {"format": "nobody"}))
    monkeypatch.setattr(export.convert, "inspect", lambda src: {})
    with pytest.raises(PipelineCheckpointError, match=r"format 'nobody'.*no model kind.*register_kind"):
        export.export(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _entries(src, record):
    from lightning_pipe.models.files import CheckpointEntries

    return CheckpointEntries(src, record, "a test", {}, frozenset(), {}, lambda names, size: iter(()))


# ---------------------------------------------------------------------------------------------------- two ranks
@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """One 2-rank launch: start from a toy directory, train 2 steps, save, resume to 4, save; then export here."""
    work = tmp_path_factory.mktemp("toy")
    torch.manual_seed(3)
    start = ToyNet().state_dict()
    save_toy({k: v for k, v in start.items() if not k.endswith("scale")}, work / "start")
    run_script("toy_kind.py", str(work), nprocs=2, timeout=300)
    ranks = [torch.load(work / f"toy.rank{r}.pt", weights_only=True) for r in range(2)]
    with register():
        exported = export.export(work / "ckpt-final", work / "exported")
    return work, ranks, exported


def _merged(ranks, key):
    return {name: value for rank in ranks for name, value in rank[key].items()}


@pytest.mark.slow
def test_it_trains_from_its_own_directory(toy_run):
    work, ranks, _ = toy_run
    stored = load_toy(work / "start")
    assert all(rank["kind"] == "toy network" for rank in ranks)
    assert (
        any(k.startswith("net.inp.") for k in ranks[0]["start"])
        and not ranks[0]["start"].keys() & ranks[1]["start"].keys()
    )
    start = _merged(ranks, "start")
    assert sorted(disk_name(k.removeprefix("net.")) for k in start) == sorted(stored)
    assert all(torch.equal(v, stored[disk_name(k.removeprefix("net."))]) for k, v in start.items())
    scales = {name: value for rank in ranks for name, value in rank["scales"].items()}
    assert len(scales) == 4 and torch.equal(scales["net.cells.b"], torch.full((8,), 0.5))
    assert all(len(rank["losses"]) == 2 for rank in ranks) and all(torch.isfinite(torch.tensor(ranks[1]["losses"])))


@pytest.mark.slow
def test_it_resumes_from_its_checkpoint(toy_run):
    _, ranks, _ = toy_run
    assert all(rank["resumed_at"] == 2 and len(rank["resumed_losses"]) == 2 for rank in ranks)
    trained, resumed = _merged(ranks, "after_first"), _merged(ranks, "resumed_start")
    assert trained.keys() == resumed.keys() and all(torch.equal(trained[k], resumed[k]) for k in trained)
    assert not all(torch.equal(trained[k], v) for k, v in _merged(ranks, "start").items())


@pytest.mark.slow
def test_its_checkpoint_records_its_format_and_exports_back_to_it(toy_run):
    work, ranks, exported = toy_run
    manifest = json.loads((work / "ckpt-final" / fmt.MANIFEST).read_text())
    assert manifest[fmt.NETWORK_RECORD] == {"format": "toy", "attribute": "net", "class": "ToyNet"}
    final = _merged(ranks, "final")
    written = load_toy(exported)
    assert sorted(written) == sorted(disk_name(k.removeprefix("net.")) for k in final)
    assert all(torch.equal(written[disk_name(k.removeprefix("net."))], v) for k, v in final.items())
    net = ToyNet()
    state = {k: written[disk_name(k)] for k in net.state_dict()}
    net.load_state_dict(state)  # the toy format round-trips into its network
