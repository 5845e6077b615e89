"""The loops the strategy replaces, written by hand as the pipelining tutorial (seed 000) writes them.

- :func:`pipeline_loop` (one step at a time: :class:`HandPipeline`): every rank builds the full network, keeps its
  own stages, wraps them in ``PipelineStage``, builds the torch schedule with a loss function and drives
  ``schedule.step`` itself: the inputs on the rank holding the first stage, the targets (and a list for the losses,
  whose mean it reads back as the tutorial does) on the rank holding the last one. Zero the gradients, step, step the
  optimizer.
- :func:`single_loop`: one process holding the whole network, the batch split into the same microbatches, gradients
  accumulated over them, one optimizer step: what the pipeline is compared with.

Both stamp the clock at the start of every step (after the DataLoader produced the batch) and once after the last.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.common import LR, Clock, ModelSpec, dataset, loader, loss_fn, make_network


def placement(schedule: str, pipeline_size: int, stages_per_rank: int) -> list[int]:
    """The pipeline rank of every stage: round robin, or a V for the V-shaped schedules (as the strategy does)."""
    num_stages = pipeline_size * stages_per_rank
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        return [s if s < pipeline_size else 2 * pipeline_size - 1 - s for s in range(num_stages)]
    return [s % pipeline_size for s in range(num_stages)]


def stage_blocks(depth: int, num_stages: int) -> list[range]:
    """Blocks of each stage: an even split, the first stages taking one more when they do not divide evenly."""
    base, extra = divmod(depth, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


class HandPipeline:
    """This rank's part of the hand-written pipeline: the network built whole, this rank's stages in
    ``PipelineStage``, the torch schedule with a loss function, SGD; :meth:`step` trains one batch."""

    def __init__(
        self,
        spec: ModelSpec,
        schedule_name: str,
        microbatches: int,
        rank: int,
        world: int,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        single = schedule_name in ("GPipe", "1F1B")
        stages_per_rank = 1 if single else 2
        ranks = placement(schedule_name, world, stages_per_rank)
        num_stages = len(ranks)
        torch.manual_seed(seed)
        network = make_network(spec)
        blocks = stage_blocks(spec.depth, num_stages)
        mine = [s for s in range(num_stages) if ranks[s] == rank]
        modules = {s: torch.nn.Sequential(*[network[i] for i in blocks[s]]).to(device) for s in mine}
        stages = [PipelineStage(modules[s], s, num_stages, device) for s in mine]
        cls = get_schedule_class(schedule_name)
        self.schedule = cls(stages[0] if single else stages, microbatches, loss_fn=loss_fn)
        params = [p for m in modules.values() for p in m.parameters()]
        self.optimizer = torch.optim.SGD(params, lr=LR)
        self.has_first, self.has_last = 0 in mine, num_stages - 1 in mine
        self.device = device
        self.history: list[float] = []
        for m in modules.values():
            m.train()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        self.forward_backward(inputs, targets)
        self.optimizer.step()

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """The schedule's step on one batch (gradients accumulate; the loss is read back on the last stage)."""
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        kwargs: dict[str, Any] = {}
        if self.has_last:
            losses: list[torch.Tensor] = []
            kwargs = {"target": targets, "losses": losses}
        if self.has_first:
            self.schedule.step(inputs, **kwargs)
        else:
            self.schedule.step(**kwargs)
        if self.has_last:
            self.history.append(float(torch.stack(losses).detach().mean()))


def pipeline_loop(
    spec: ModelSpec,
    schedule_name: str,
    microbatches: int,
    steps: int,
    rank: int,
    world: int,
    device: torch.device,
    seed: int = 0,
) -> Clock:
    pipeline = HandPipeline(spec, schedule_name, microbatches, rank, world, device, seed)
    data = loader(dataset(spec, steps), spec.batch)
    clock = Clock(device)
    for inputs, targets in data:
        clock.tick()
        pipeline.step(inputs, targets)
    clock.tick()
    return clock


def single_loop(spec: ModelSpec, microbatches: int, steps: int, device: torch.device, seed: int = 0) -> Clock:
    torch.manual_seed(seed)
    network = make_network(spec).to(device)
    optimizer = torch.optim.SGD(network.parameters(), lr=LR)
    data = loader(dataset(spec, steps), spec.batch)
    clock = Clock(device)
    history: list[float] = []
    network.train()
    for inputs, targets in data:
        clock.tick()
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad()
        total = torch.zeros((), device=device)
        for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches)):
            loss = loss_fn(network(x), y) / microbatches
            loss.backward()
            total += loss.detach()
        history.append(float(total))
        optimizer.step()
    clock.tick()
    return clock
