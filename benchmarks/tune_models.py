"""The workloads of benchmarks/tune.py: three training jobs whose best pipeline settings differ.

- ``mlp``: the compute-bound network of benchmarks/common.py (8 x Linear(1024) + ReLU, batch 512, SGD);
- ``gpt``: the GPT example (examples/gpt: 4 blocks of width 128, context 128, batch 16, AdamW) on its own data, the
  Python standard library's bytes (read once per process and kept);
- ``gpt-vocab``: the same blocks under a 16,384-token embedding and head (random tokens, batch 16, context 64): the
  head is worth several blocks, so the last stage is the heavy one;
- ``small``: the small network of benchmarks/common.py (4 x Linear(256) + ReLU, batch 64, SGD), whose copies fit and
  whose gradients are few: the layout run's case for no pipeline at all.

Each has a ``batch_size`` where Lightning's batch-size finder looks (the module's attribute, or the GPT example's data
module's hyperparameter), so that the tuner and the layout sweep can keep the global batch under another
data-parallel size.

``--quick`` uses ``tiny`` versions of each (same code paths, a fraction of a second per step).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))

from train import GPT, Block, GPTLightning, StdlibBytes, Windows, read_corpus, stdlib_sources  # noqa: E402

from benchmarks.common import MODELS, dataset, loader  # noqa: E402
from benchmarks.lit import BenchModule  # noqa: E402


@functools.cache
def _corpus(block_size: int) -> tuple[Windows, Windows]:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = read_corpus(stdlib_sources(str(root)), root, 20)
    return Windows(train, block_size), Windows(val, block_size)


class CachedStdlib(StdlibBytes):
    """The example's data module, reading the corpus once per process (every trial and sweep case would re-read it)."""

    def setup(self, stage: str) -> None:
        self.train_set, self.val_set = _corpus(self.hparams.block_size)


class MLPModule(BenchModule):
    """benchmarks/lit.py's module with its batch where the batch-size finder looks (``batch_size``), the data kept:
    ``batches`` batches of the spec's batch in all, shared among the replicas."""

    def __init__(self, spec: Any, batch: int, batches: int) -> None:
        super().__init__(spec, batch, batches)
        self.batch_size = batch

    def train_dataloader(self) -> Any:
        return loader(dataset(self.spec, self.batches), self.batch_size)


class VocabGPT(L.LightningModule):
    """The example's blocks under a large-vocabulary embedding and head, on random tokens."""

    def __init__(self, vocab: int, block_size: int, n_layer: int, n_embd: int, batch_size: int, batches: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        # The data is ``batches`` batches of the first batch size, whatever the batch size is set to later.
        self.samples = batch_size * batches
        self.model = VocabNet(vocab, block_size, n_layer, n_embd)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, h.vocab, (self.samples, h.block_size + 1), generator=g)
        data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        return DataLoader(data, batch_size=h.batch_size, drop_last=True)


class VocabNet(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, n_embd: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, 4, 0.0) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)

    forward = GPT.forward  # skips the units other stages own


#: workload -> (size -> keyword arguments)
SIZES = {
    "mlp": {"full": "compute", "quick": "tiny"},
    "gpt": {"full": dict(block_size=128, n_layer=4, n_head=4, n_embd=128), "quick": dict(n_layer=4, n_embd=32)},
    "gpt-vocab": {
        "full": dict(vocab=16384, block_size=64, n_layer=4, n_embd=128, batch_size=16),
        "quick": dict(vocab=512, block_size=16, n_layer=4, n_embd=32, batch_size=8),
    },
    "small": {"full": "small", "quick": "tiny"},
    "wide": {"full": "wide", "quick": "tiny"},
    "deep": {"full": "deep", "quick": "tiny"},
}
WORKLOADS = tuple(SIZES)


def build(workload: str, quick: bool, batches: int) -> tuple[L.LightningModule, dict[str, Any]]:
    """A fresh LightningModule of ``workload`` (seeded) and the ``fit`` keyword arguments for its data."""
    size = SIZES[workload]["quick" if quick else "full"]
    torch.manual_seed(0)
    if workload in ("mlp", "small", "wide", "deep"):
        spec = MODELS[size]
        return MLPModule(spec, spec.batch, batches), {}
    if workload == "gpt":
        block = size.get("block_size", 32)
        return GPTLightning(**{"block_size": block, **size}), {
            "datamodule": CachedStdlib(block, 16 if not quick else 8)
        }
    return VocabGPT(**size, batches=batches), {}
