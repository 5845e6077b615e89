"""A model kind defined only in the tests, added with ``lightning_pipe.models.register_kind``: nothing in
``lightning_pipe/`` knows it (tests/test_model_kind_toy.py).

- Its network (:class:`ToyNet`): an input layer, a ``ModuleDict`` of cells (each with a buffer its constructor computes,
  which the meta device loses) and an output layer; its own unit finder (:meth:`ToyKind.layout`).
- Its format (:class:`ToyFiles`), a directory::

      toy_index.json        {"format": "toy", "tensors": {disk name: file}}
      <disk name>.pt        one tensor per file, under the toy's own names (``cells.a.lin.weight`` as
                            ``cell-a~lin~weight``)

  read per rank for ``init_weights=DIR`` and written back by ``export-hf`` from a checkpoint (the kind's record names
  the format).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe.models import Registration, register_kind
from lightning_pipe.models.files import Assign, CheckpointEntries, ExportOptions, LoadPlan, LoadTarget, copy_whole
from lightning_pipe.models.plain import PlainKind
from lightning_pipe.models.units import Layout

INDEX = "toy_index.json"
CELLS = ("a", "b", "c", "d")
WIDTH = 8


class ToyCell(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.index = index
        # computed here, not stored: lost on the meta device, set again by the toy kind's hook
        self.register_buffer("scale", toy_scale(index), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x)) * self.scale


def toy_scale(index: int, device: Any = None) -> torch.Tensor:
    return torch.full((WIDTH,), 1.0 / (index + 1), device=device)


class ToyNet(nn.Module):
    """Its forward skips units another stage holds (``None``, or gone from ``cells``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, WIDTH)
        self.cells = nn.ModuleDict({name: ToyCell(i) for i, name in enumerate(CELLS)})
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            x = self.inp(x)
        for cell in self.cells.values():
            x = cell(x)
        return self.out(x) if self.out is not None else x


def disk_name(name: str) -> str:
    """The toy format's name for the network's tensor ``name``."""
    return name.replace("cells.", "cell-").replace(".", "~")


class ToyFiles:
    """The toy format (:class:`~lightning_pipe.models.files.StateDictAdapter`)."""

    name = "toy"
    title = "toy model directory"

    def reads(self, path: Path) -> bool:
        return (Path(path) / INDEX).is_file()

    def plan_load(self, path: Path, target: LoadTarget) -> LoadPlan:
        stored = json.loads((Path(path) / INDEX).read_text())["tensors"]
        targets: dict[str, list[torch.Tensor]] = {}
        missing = []
        for key, tensor in target.state.items():
            name = disk_name(key.removeprefix(target.network_prefix))
            if name in stored:
                targets[name] = [tensor]
            else:
                missing.append(key)
        return LoadPlan({n: Path(path) / f for n, f in stored.items()}, targets, missing, stored=frozenset(stored))

    def copy_into(self, plan: LoadPlan, assign: Assign = copy_whole) -> int:
        read = 0
        for name, targets in plan.targets.items():
            value = torch.load(plan.directory[name], weights_only=True)
            for target in targets:
                assign(target, value)
            read += value.numel() * value.element_size()
        return read

    def plan_adapters(self, path: Path, network: nn.Module) -> None:
        return None

    def mismatch_message(self, path: Path, missing: Sequence[str], unexpected: Sequence[str], strict: bool) -> str:
        return f"toy directory {str(path)!r}: missing {sorted(missing)}, unexpected {sorted(unexpected)}"

    def new_head_message(self, path: Path, network: nn.Module, plan: LoadPlan, keys: Sequence[str]) -> str:
        return f"toy directory {str(path)!r}: new {sorted(keys)}"

    def export(self, entries: CheckpointEntries, out: Path, options: ExportOptions) -> None:
        record = entries.record or {}
        attribute = options.attribute if options.attribute is not None else record["attribute"]
        prefix = f"{attribute}." if attribute else ""
        names = sorted(n for n in entries.stored if n.startswith(prefix))
        tensors: dict[str, torch.Tensor] = {}
        for chunk in entries.read(names, 2**20):
            tensors.update(chunk)
        save_toy({name.removeprefix(prefix): tensors[name] for name in names}, out)


def save_toy(state: Mapping[str, torch.Tensor], path: Path) -> Path:
    """Write ``state`` (the network's names) as a toy model directory."""
    path.mkdir(parents=True, exist_ok=True)
    index = {}
    for name, tensor in state.items():
        index[disk_name(name)] = f"{disk_name(name)}.pt"
        torch.save(tensor.detach().clone(), path / index[disk_name(name)])
    (path / INDEX).write_text(json.dumps({"format": "toy", "tensors": index}))
    return path


def load_toy(path: Path) -> dict[str, torch.Tensor]:
    """A toy model directory's tensors by disk name."""
    stored = json.loads((Path(path) / INDEX).read_text())["tensors"]
    return {name: torch.load(Path(path) / file, weights_only=True) for name, file in stored.items()}


class ToyKind(PlainKind):
    """The toy network's kind: its own units, its own record and files."""

    name = "toy network"

    def layout(self, network: nn.Module, blocks: str = "auto") -> Layout:
        return Layout(pre=("inp",), blocks=tuple(f"cells.{name}" for name in network.cells), post=("out",))

    def record(self, network: nn.Module, attribute: str) -> dict[str, Any]:
        return {"format": ToyFiles.name, "attribute": attribute, "class": type(network).__name__}

    def state_dict_adapter(self) -> ToyFiles:
        return ToyFiles()


def claim(network: nn.Module) -> ToyKind | None:
    return ToyKind() if isinstance(network, ToyNet) else None


def restore(module: nn.Module) -> bool:
    """The toy cells' buffer, recomputed after meta construction."""
    if not isinstance(module, ToyCell):
        return False
    with torch.no_grad():
        module.scale.copy_(toy_scale(module.index, module.scale.device))
    return True


def register() -> Registration:
    return register_kind(claim, restore=restore, files=ToyFiles())


class LitToy(L.LightningModule):
    """Builds its :class:`ToyNet` in ``configure_model`` (on the meta device under the pipeline)."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.net: ToyNet | None = None
        self.step_losses: list[float] = []
        self.started_at: int | None = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = ToyNet()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_train_start(self) -> None:
        self.started_at = self.trainer.global_step

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.step_losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=8)
