"""A network whose forward is not ready for stages; the stage's error must say where and why.
Usage: stage_errors.py KIND  (KIND: "none-unit" or "input-shape")."""

import sys

import lightning.pytorch as L
import torch.nn.functional as F

import lightning_pipe
from tests.models import VOCAB, LitLM, TinyLM


class NotNoneSafe(TinyLM):
    def forward(self, idx):
        h = self.embed(idx)  # absent on stage 1: TypeError 'NoneType' object is not callable
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h)) if self.head is not None else h


class ReadsInputShape(TinyLM):
    def forward(self, idx):
        b, t = idx.size()  # on stage 1 `idx` is the (B, T, C) activation: ValueError
        h = self.embed(idx) if self.embed is not None else idx
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h)) if self.head is not None else h


class Lit(LitLM):
    def __init__(self, kind: str) -> None:
        super().__init__(n_layers=4)
        self.model = {"none-unit": NotNoneSafe, "input-shape": ReadsInputShape}[kind](n_layers=4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))


if __name__ == "__main__":
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=lightning_pipe.PipelineParallelStrategy(schedule="1F1B"),
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Lit(sys.argv[1]))
