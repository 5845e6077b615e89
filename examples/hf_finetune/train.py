"""Fine-tune a pretrained Hugging Face causal LM under the pipeline, starting from its directory.

The network is built from the directory's config in ``configure_model`` (on the meta device: no weights yet), and
``PipelineParallelStrategy(init_weights=<directory>)`` loads each process's stages from the directory's safetensors
shards, each process reading only its own tensors. The corpus is the Python standard library's ``.py`` files read
as bytes (nothing is downloaded). Run from the repository root, after ``pretrained.py``:

    python examples/hf_finetune/train.py fit --config examples/hf_finetune/config.yaml
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import lightning.pytorch as L
import torch
import transformers
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset

import lightning_pipe  # noqa: F401  (registers strategy="pipeline" and makes the class path importable)


def stdlib_windows(seq: int, files: slice, root: str | None = None) -> TensorDataset:
    """Windows of ``seq`` bytes of the standard library's ``.py`` files ``files`` (in sorted order)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    data = b"".join(p.read_bytes() for p in sorted(base.glob("*.py"))[files])
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    return TensorDataset(tokens[: len(tokens) // seq * seq].view(-1, seq))


class FineTune(L.LightningModule):
    def __init__(self, pretrained: str = "pretrained/tiny-llama", lr: float = 1e-3) -> None:
        """
        Args:
            pretrained: The Hugging Face model directory the network's config is read from (pass the same directory
                as the strategy's ``init_weights``, which loads its weights).
            lr: AdamW learning rate.
        """
        super().__init__()
        self.save_hyperparameters()
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:  # a second Trainer entry keeps the network
            config = transformers.AutoConfig.from_pretrained(self.hparams.pretrained)
            self.model = transformers.AutoModelForCausalLM.from_config(config)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class StdlibBytes(L.LightningDataModule):
    def __init__(self, seq: int = 128, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self):
        data = stdlib_windows(self.hparams.seq, slice(0, 150))
        return DataLoader(data, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self):
        data = stdlib_windows(self.hparams.seq, slice(150, 170))
        return DataLoader(data, batch_size=self.hparams.batch_size, drop_last=True)


if __name__ == "__main__":
    LightningCLI(FineTune, StdlibBytes)
