"""BEFORE: the hand-written ``torch.distributed.pipelining`` training loop of the pipeline tutorial (seed 000).

Every process builds the model, cuts it down to its own stage, wraps it in a ``PipelineStage``, builds a schedule
with a loss function and drives ``schedule.step`` itself: inputs on the first rank, targets on the last, nothing
on the ranks in between. Run it with torchrun (2 processes, CPU):

    torchrun --nproc-per-node=2 examples/migrate/before.py --steps 20

``train.py`` next to this file is the same training with PipelineParallelStrategy; README.md compares the two.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import VOCAB, Decoder, text_windows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--losses", type=Path, default=None, help="write the per-step losses here (JSON)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="save a DCP checkpoint here at the end")
    args = parser.parse_args()

    # 1. The process group (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")

    # 2. The full model, then this rank's part of it: the first rank keeps the embeddings, the last one the norm and
    #    head, and every rank an equal share of the layers. (The tutorial builds on the meta device and calls
    #    to_empty() + reset_parameters() to avoid allocating the full model; this small one is built for real.)
    torch.manual_seed(0)
    model = Decoder()
    per_rank = len(model.layers) // world
    model.layers = torch.nn.ModuleList(model.layers[rank * per_rank : (rank + 1) * per_rank])
    if rank != 0:
        model.embed = model.pos = None
    if rank != world - 1:
        model.norm = model.head = None
    model.to(device)

    # 3. The stage and the schedule. The loss function runs on the last rank, once per microbatch.
    stage = PipelineStage(model, stage_index=rank, num_stages=world, device=device)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))

    schedule = ScheduleGPipe(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)

    # 4. Data, optimizer: as on one device. Every rank iterates the same batches (rank 0 needs the inputs, the last
    #    rank the targets), so the loader must not shard or shuffle differently per rank.
    x, y = text_windows()
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    # 5. The loop: never call the model; each rank feeds the schedule its own part of the batch.
    history: list[float] = []
    model.train()
    for step, (inputs, targets) in enumerate(loader):
        if step == args.steps:
            break
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(inputs)
        elif rank == world - 1:
            losses: list[torch.Tensor] = []
            schedule.step(target=targets, losses=losses)
            history.append(float(torch.stack(losses).mean()))
        else:
            schedule.step()
        optimizer.step()
        if rank == world - 1 and step % 10 == 0:
            print(f"step {step}: loss {history[-1]:.4f}", flush=True)

    # 6. Checkpoint: no rank holds the whole model, so each saves its shard with Distributed Checkpoint. Parameter
    #    names are local ("layers.0" on rank 1 is the model's layer 2): resuming needs the same world size.
    if args.checkpoint is not None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        dist.barrier()
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(args.checkpoint))
        dist.barrier()

    if rank == world - 1 and args.losses is not None:
        args.losses.write_text(json.dumps(history))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
