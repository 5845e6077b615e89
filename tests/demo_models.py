"""Lightning's demo transformer (``lightning.pytorch.demos.LightningTransformer``) fed generated tokens instead of
WikiText2: its ``prepare_data`` download is neutralised, its network built without dropout (dropout's draws follow the
pipeline's stages and microbatches, not one device's), the rest is Lightning's."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.demos import LightningTransformer, Transformer
from torch.utils.data import DataLoader, TensorDataset

from tests.models import quiet_trainer

VOCAB = 50


class GeneratedTokensTransformer(LightningTransformer):
    def __init__(self) -> None:
        super().__init__(vocab_size=VOCAB)
        self.model = Transformer(vocab_size=VOCAB, dropout=0.0)
        self.losses: list[float] = []

    def prepare_data(self) -> None:
        pass  # the demo downloads WikiText2 here

    def train_dataloader(self) -> DataLoader:
        tokens = torch.randint(0, VOCAB, (16, 11), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]))  # the demo's batches of one sample

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def fit_demo_transformer(**trainer_kwargs: Any) -> dict[str, Any]:
    """Seed, fit 4 steps; the step losses and this rank's parameters."""
    L.seed_everything(0)
    model = GeneratedTokensTransformer()
    trainer = quiet_trainer(max_steps=4, **trainer_kwargs)
    trainer.fit(model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": model.losses, "state": state, "global_rank": trainer.global_rank}
