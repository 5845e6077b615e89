"""A Fabric loop pipelined over 2 processes: the byte-level GPT of ``examples/gpt`` on the standard library's sources.

    python examples/fabric/train_gpt.py                       # Fabric(strategy="pipeline"), 2 CPU processes
    python examples/fabric/train_gpt.py --devices 1 --plain   # the same loop under Fabric(devices=1)

The loop is an ordinary Fabric loop; the one change for the pipeline is ``loss = model.step(forward_and_loss, batch)``
in place of ``loss = forward_and_loss(batch)`` (docs/fabric.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import sysconfig
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import lightning_pipe

# The model and the data of examples/gpt/train.py.
_spec = importlib.util.spec_from_file_location("gpt_example", Path(__file__).resolve().parents[1] / "gpt" / "train.py")
gpt_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt_example)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--plain", action="store_true", help="Fabric(devices=N) without the pipeline")
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--save", default=None, help="a checkpoint directory written at the end (fabric.save)")
    args = parser.parse_args()

    if args.plain:
        fabric = L.Fabric(accelerator="cpu", devices=args.devices)
    else:
        strategy = lightning_pipe.PipelineFabricStrategy(schedule=args.schedule)
        fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=args.devices)
    fabric.launch()
    fabric.seed_everything(0)

    block_size = 64
    # `empty_init=True` would build it on the meta device, each rank then allocating only its stages (initialised per
    # unit: other start weights than this whole-model init, which the --plain run shares).
    with fabric.init_module():
        model = gpt_example.GPT(block_size=block_size, n_layer=4, n_head=4, n_embd=64, dropout=0.0)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    root = Path(sysconfig.get_paths()["stdlib"])
    train_bytes, _ = gpt_example.read_corpus(gpt_example.stdlib_sources()[:200], root, val_every=20)
    windows = gpt_example.Windows(train_bytes, block_size)
    loader = fabric.setup_dataloaders(DataLoader(windows, batch_size=args.batch_size))

    def forward_and_loss(batch):
        x, y = batch
        logits = model(x)  # (B, T, VOCAB)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    state = {"model": model, "optimizer": optimizer, "step": 0}
    for i, batch in enumerate(loader):
        accumulating = (i + 1) % args.accumulate != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = forward_and_loss(batch) if args.plain else model.step(forward_and_loss, batch)
            fabric.backward(loss / args.accumulate)
        if accumulating:
            continue
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        mean = float(fabric.all_reduce(loss.detach()))
        fabric.print(f"step {state['step']}: loss {mean:.4f}, grad norm {float(norm):.3f}")
        if state["step"] == args.steps:
            break
    if args.save:
        fabric.save(args.save, state)


if __name__ == "__main__":
    main()
