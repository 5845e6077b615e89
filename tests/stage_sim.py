"""A pipeline run stage by stage in one process, without a process group: every rank's split is made on its own copy
of a LightningModule (as each process would make it), and the stages are called in order through their stage calls,
each receiving what the one before returned (detached, as torch sends it), then back-propagated in reverse.

Fast tests use it to check a frontend's routes and stage calls against the whole network, bitwise.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_pipe.settings import PipelineSettings
from lightning_pipe.split.builder import Split, split_module


@dataclass
class SimResult:
    splits: list[Split]
    #: what every stage returned, by stage
    outputs: list[Any] = field(default_factory=list)
    loss: torch.Tensor | None = None

    def grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient, by its names in the network, from the rank that holds it; a parameter tied
        across stages gets the sum of its copies' gradients (what the strategy's tie synchronisation computes)."""
        found: dict[str, torch.Tensor] = {}
        per_rank = [dict(split.network.named_parameters(remove_duplicate=False)) for split in self.splits]
        for params in per_rank:
            for name, param in params.items():
                if param.grad is not None:
                    found.setdefault(name, param.grad)
        for tie in self.splits[0].ties:
            copies = {id(p): p for params in per_rank for n in tie.names if (p := params.get(n)) is not None}
            total = sum(p.grad for p in copies.values() if p.grad is not None)
            found.update({name: total for name in tie.names})
        return found


def split_all(lightning_module: Any, world: int, **settings: Any) -> list[Split]:
    """Each pipeline rank's split of its own copy of ``lightning_module``."""
    resolved = PipelineSettings(**settings).resolve(world)
    return [
        split_module(copy.deepcopy(lightning_module), resolved, pipeline_rank=r, device=torch.device("cpu"))
        for r in range(world)
    ]


def run_stages(
    splits: Sequence[Split], args: tuple, kwargs: dict, loss_of: Callable[[Any], torch.Tensor], backward: bool = True
) -> SimResult:
    """One microbatch through every stage (``split.stage_call`` on each body), then backward through all."""
    first = splits[0]
    result = SimResult(list(splits))
    inputs: list[tuple] = []
    received: tuple | None = None
    n = first.num_stages
    for s in range(n):
        split = splits[first.stage_ranks[s]]
        if received is not None:
            received = tuple(t.detach().requires_grad_(t.requires_grad) for t in received)
        inputs.append(received or ())
        out = split.stage_call(split.bodies[s], args, kwargs, received, s == 0, s == n - 1)
        result.outputs.append(out)
        received = out if isinstance(out, tuple) else (out,)
    result.loss = loss_of(result.outputs[-1])
    if backward:
        result.loss.backward()
        for s in range(n - 2, -1, -1):
            outs = result.outputs[s]
            outs = outs if isinstance(outs, tuple) else (outs,)
            pairs = [(o, t.grad) for o, t in zip(outs, inputs[s + 1]) if t.grad is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return result


def whole_network_grads(network: torch.nn.Module, args: tuple, kwargs: dict, loss_of: Callable) -> tuple:
    """The loss and every gradient of ``network`` run whole on the same call."""
    network.zero_grad()
    loss = loss_of(network(*args, **kwargs))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in network.named_parameters() if p.grad is not None}
