"""A ``fabric.save`` checkpoint continues under the Trainer strategy and a Trainer checkpoint under Fabric: the same
network under two prefixes (``model.`` on the LightningModule, none on the Fabric module), mapped on load."""

from __future__ import annotations

import functools

import lightning.pytorch as L
import pytest
from lightning.fabric import Fabric

import lightning_pipe
from lightning_pipe.checkpoint import format as fmt
from lightning_pipe.errors import PipelineCheckpointError
from tests.fabric_loop import LitGPT2, train
from tests.models import quiet_trainer

STEPS, SAVE_AT = 4, 2


def _fabric() -> Fabric:
    fabric = Fabric(strategy="pipeline", accelerator="cpu", devices=1)
    fabric.launch()
    return fabric


@functools.cache
def _uninterrupted() -> list[float]:
    fabric = _fabric()
    losses, _, _ = train(fabric, {"steps": STEPS}, pipelined=True)
    fabric.strategy.teardown()
    return losses


@pytest.fixture(scope="module")
def fabric_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fabric") / "ckpt"
    fabric = _fabric()
    losses, _, _ = train(fabric, {"steps": STEPS, "save_at": SAVE_AT, "save_to": str(path)}, pipelined=True)
    fabric.strategy.teardown()
    return path, losses


def _trainer(steps: int):
    return quiet_trainer(devices=1, max_steps=steps, strategy=lightning_pipe.PipelineParallelStrategy())


def test_fabric_checkpoint_continues_under_the_trainer(fabric_checkpoint):
    path, _ = fabric_checkpoint
    assert fmt.read_manifest(path)[fmt.NETWORK_PREFIX] == ""
    L.seed_everything(5)  # other start weights: the checkpoint's replace them
    module = LitGPT2(SAVE_AT, STEPS)
    with pytest.warns(UserWarning, match=r"no resume point.*by `fabric.save`"):
        _trainer(STEPS - SAVE_AT).fit(module, ckpt_path=path)
    assert module.step_losses == _uninterrupted()[SAVE_AT:]  # the same op sequence: bitwise
    assert module.loaded == {"iter_num": SAVE_AT}  # the Fabric state's values reach `on_load_checkpoint`


def test_trainer_checkpoint_continues_under_fabric(tmp_path):
    L.seed_everything(0)  # the Fabric loop's start weights
    module = LitGPT2(0, SAVE_AT)
    trainer = _trainer(SAVE_AT)
    trainer.fit(module)
    assert module.step_losses == _uninterrupted()[:SAVE_AT]
    trainer.save_checkpoint(tmp_path / "ckpt")
    assert fmt.read_manifest(tmp_path / "ckpt")[fmt.NETWORK_PREFIX] == "model."
    fabric = _fabric()
    losses, _, _ = train(fabric, {"steps": STEPS, "resume_from": str(tmp_path / "ckpt")}, pipelined=True)
    fabric.strategy.teardown()
    assert losses == _uninterrupted()[SAVE_AT:]


def test_fabric_checkpoint_into_a_trainer_with_lr_schedulers_is_refused(fabric_checkpoint):
    path, _ = fabric_checkpoint
    with pytest.raises(PipelineCheckpointError, match=r"saved by `fabric.save`.*its 1 LR scheduler\(s\)"):
        _trainer(1).fit(LitGPT2(SAVE_AT, STEPS, schedulers=True), ckpt_path=path)


def test_stored_names_map_the_network_prefix():
    assert fmt.stored_names(["model.a", "extra"], "model.", "") == {"model.a": "a", "extra": "extra"}
    assert fmt.stored_names(["a"], "", "model.") == {"a": "model.a"}
    assert fmt.stored_names(["model.a"], "model.", "model.") == {"model.a": "model.a"}


def test_stored_names_refuse_two_names_for_one_entry():
    with pytest.raises(PipelineCheckpointError, match=r"prefix '' .* under 'model.'.*\['model.head', 'head'\].*'head'"):
        fmt.stored_names(["model.head", "head"], "model.", "")


def test_hf_directory_starts_a_fabric_run_and_its_checkpoint_exports(tmp_path):
    """``init_weights=<Hugging Face dir>`` fills the model built on the meta device; ``export-hf`` of the
    ``fabric.save`` checkpoint after a step gives the trained model back to ``from_pretrained``."""
    transformers = pytest.importorskip("transformers")
    import torch
    import torch.nn.functional as F

    from lightning_pipe.checkpoint.__main__ import main as cli
    from tests.hf_pretrained import save_pretrained

    original = save_pretrained(tmp_path / "original", "llama", tie=True, layers=2)
    fabric = Fabric(strategy=lightning_pipe.PipelineFabricStrategy(init_weights=original), accelerator="cpu", devices=1)
    fabric.launch()
    config = transformers.AutoConfig.from_pretrained(original)
    with fabric.init_module(empty_init=True):
        network = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = fabric.setup_module(network)
    start = transformers.AutoModelForCausalLM.from_pretrained(original, attn_implementation="eager").state_dict()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in start.items())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    ids = torch.randint(0, config.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))

    def forward_and_loss(batch):
        logits = model(batch).logits  # (B, T, vocab)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

    fabric.backward(model.step(forward_and_loss, ids))
    optimizer.step()
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fabric.strategy.teardown()
    assert cli(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--no-progress"]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert exported.state_dict().keys() == start.keys()
    assert all(torch.equal(v, trained[k]) for k, v in exported.state_dict().items())
    assert any(not torch.equal(v, start[k]) for k, v in trained.items())  # the step changed them
