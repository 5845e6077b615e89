"""Train the same network twice in one process group: cut by module surgery (its forward skips ``None`` units) and
cut by torch's tracer (an unmodified forward). Each rank saves both runs' losses and parameter names.

Usage: trace_frontend.py OUT_DIR
"""

import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from torch import nn

import lightning_pipe
from tests.models import SEQ, VOCAB, Block, LitLM


class PlainLM(nn.Module):
    """TinyLM's layers in TinyLM's order (so the same seed gives the same weights), with no `None` checks."""

    def __init__(self, dim: int = 16, n_layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class LitPlain(LitLM):
    def __init__(self) -> None:
        super().__init__(n_layers=4, meta_init=True)  # meta_init: LitLM builds no TinyLM in __init__
        self.model = PlainLM()
        self.example_input_array = torch.zeros(8, SEQ, dtype=torch.long)


def main() -> None:
    out = Path(sys.argv[1])
    results = {}
    for frontend in ("modules", "trace"):
        L.seed_everything(0)
        model = LitLM(n_layers=4) if frontend == "modules" else LitPlain()
        trainer = L.Trainer(
            strategy=lightning_pipe.PipelineParallelStrategy(frontend=frontend),
            accelerator="cpu",
            devices=2,
            max_steps=4,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model)
        results[frontend] = {"losses": model.step_losses, "names": sorted(model.state_dict())}
    torch.save(results, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
