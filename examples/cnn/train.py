"""A small ResNet (or AlexNet) split in two pipeline stages, trained on scikit-learn's bundled 8x8 digits.

The data set ships inside scikit-learn (``sklearn.datasets.load_digits``): nothing is downloaded. The networks are
plain ``nn.Sequential`` models, so they need no change at all for pipelining; ``split_points`` in the config puts
the stage boundary where the hand-written splits of the ResNet-50 and AlexNet tutorials put it.

The ResNet normalises with GroupNorm by default, per sample, so the pipeline trains exactly as one device does on the
same batches. ``--model.norm=batch`` gives it ResNet's BatchNorm, which normalises over the batch: a pipeline runs it
once per microbatch, so its statistics come from 8 images instead of 32 and the results differ from one device (the
strategy says so at fit start). AlexNet's dropout draws its masks per microbatch: statistically the same, not the
same numbers. Run from the repository root:

    python examples/cnn/train.py fit --config examples/cnn/config.yaml
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import lightning_pipe  # noqa: F401  (registers strategy="pipeline" and makes the class path importable)

NUM_CLASSES = 10


Norm = Literal["group", "batch"]


def norm_layer(norm: Norm, channels: int) -> nn.Module:
    """GroupNorm (per sample: exact under microbatching) or BatchNorm (over the batch: over each microbatch here)."""
    return nn.GroupNorm(8, channels) if norm == "group" else nn.BatchNorm2d(channels)


class BasicBlock(nn.Module):
    """ResNet's two-convolution residual block, with a 1x1 projection when the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: Norm = "group") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = norm_layer(norm, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = norm_layer(norm, c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), norm_layer(norm, c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet(width: int, norm: Norm = "group") -> nn.Sequential:
    """ResNet-18's layout at 8x8 scale. Seed 003's ResNet-50 split puts conv1..layer2 on device 0, the rest on 1."""
    return nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(1, width, 3, 1, 1, bias=False),
            bn1=norm_layer(norm, width),
            relu=nn.ReLU(),
            layer1=BasicBlock(width, width, 1, norm),  # (B, w, 8, 8)
            layer2=BasicBlock(width, 2 * width, 2, norm),  # (B, 2w, 4, 4)
            layer3=BasicBlock(2 * width, 4 * width, 2, norm),  # (B, 4w, 2, 2)
            layer4=BasicBlock(4 * width, 8 * width, 2, norm),  # (B, 8w, 1, 1)
            avgpool=nn.AdaptiveAvgPool2d(1),
            flatten=nn.Flatten(),
            fc=nn.Linear(8 * width, NUM_CLASSES),
        )
    )


def alexnet(width: int) -> nn.Sequential:
    """AlexNet's layout (convolutional features, then a fully connected classifier) at 8x8 scale."""
    return nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(1, width, 3, 1, 1),
            relu1=nn.ReLU(),
            conv2=nn.Conv2d(width, 2 * width, 3, 1, 1),
            relu2=nn.ReLU(),
            pool1=nn.MaxPool2d(2),  # (B, 2w, 4, 4)
            conv3=nn.Conv2d(2 * width, 4 * width, 3, 1, 1),
            relu3=nn.ReLU(),
            pool2=nn.MaxPool2d(2),  # (B, 4w, 2, 2)
            flatten=nn.Flatten(),
            fc1=nn.Linear(16 * width, 256),
            relu4=nn.ReLU(),
            dropout=nn.Dropout(0.2),
            fc2=nn.Linear(256, NUM_CLASSES),
        )
    )


class DigitsClassifier(L.LightningModule):
    def __init__(
        self, arch: Literal["resnet", "alexnet"] = "resnet", width: int = 16, lr: float = 0.05, norm: Norm = "group"
    ) -> None:
        """
        Args:
            arch: ``resnet`` (split as seed 003 splits ResNet-50) or ``alexnet`` (features | classifier, seed 002).
            width: Channels of the first convolution.
            lr: SGD learning rate (momentum 0.9, cosine decay over ``max_epochs``).
            norm: The ResNet's normalisation: ``group`` (per sample; the pipeline equals one device) or ``batch``
                (BatchNorm, over each microbatch under the pipeline: differs from one device, and the strategy says
                so).
        """
        super().__init__()
        self.save_hyperparameters()
        self.net = resnet(width, norm) if arch == "resnet" else alexnet(width)
        self.train_acc = MulticlassAccuracy(NUM_CLASSES)
        self.val_acc = MulticlassAccuracy(NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, prog_bar=True, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.val_acc(logits, y)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_acc", self.val_acc, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, weight_decay=5e-4)
        epochs = max(int(self.trainer.max_epochs or 1), 1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs)}


class Digits(L.LightningDataModule):
    """scikit-learn's 1,797 8x8 handwritten digits; a fixed 80/20 split."""

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2, seed: int = 0) -> None:
        """
        Args:
            batch_size: Images per batch; a multiple of the strategy's ``microbatches``.
            val_fraction: Share of the images held out for validation.
            seed: Seed of the train/validation split.
        """
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8), pixels 0..16
        x = (x - x.mean()) / x.std()
        y = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(self.hparams.seed))
        n_val = int(len(y) * self.hparams.val_fraction)
        self.val_set = TensorDataset(x[order[:n_val]], y[order[:n_val]])
        self.train_set = TensorDataset(x[order[n_val:]], y[order[n_val:]])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


def main() -> None:
    LightningCLI(DigitsClassifier, Digits, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
