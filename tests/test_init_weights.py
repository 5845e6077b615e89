"""``init_weights`` is where a strategy's training starts: loaded once, at its first setup, and not again when the same
Trainer validates or predicts after ``fit`` (which would silently evaluate the start weights, not the trained ones)."""

from __future__ import annotations

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader

from lightning_pipe import PipelineParallelStrategy
from tests.models import LitLM, quiet_trainer, token_dataset


class LitLMEval(LitLM):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten()))

    def val_dataloader(self):
        return DataLoader(token_dataset(8, seed=1), batch_size=8)


def test_init_weights_load_once_and_fit_then_validate_keeps_the_trained_weights(tmp_path):
    L.seed_everything(1)
    start = tmp_path / "start.pt"
    torch.save(LitLMEval(n_layers=2).state_dict(), start)
    L.seed_everything(0)
    model = LitLMEval(n_layers=2)
    trainer = quiet_trainer(
        devices=1, max_steps=2, limit_val_batches=0, strategy=PipelineParallelStrategy(init_weights=start)
    )
    trainer.fit(model)
    assert model.step_losses[0] != model.step_losses[1]
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert any(not torch.equal(trained[k], v) for k, v in torch.load(start).items())  # it trained
    trainer.validate(model, verbose=False)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)
