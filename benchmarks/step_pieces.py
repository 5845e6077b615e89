"""CPU time per call of the step path's per-microbatch and per-step pieces that the hand-written loop does not run.

    python benchmarks/step_pieces.py                      # this tree
    python benchmarks/step_pieces.py --tree /path/to/old  # another checkout (e.g. `git archive REV | tar -x -C DIR`)

Thread CPU time (``time.thread_time``), the third lowest of 9 repeats: other processes on the machine stretch the
wall clock of a piece but hardly its CPU time, so two trees run one after the other compare to a few tenths of a
microsecond. Pieces: a stage's own forward around its body (last and first stage, ``StageModule.forward`` minus the
body's call), the outcome's encoding on the last stage and decoding on the others (``sharing.flatten``; the channel's
decoder, or ``sharing.rebuild`` in a tree without one), and the step's loss from one microbatch's
(``protocol._weighted_mean``).
"""

from __future__ import annotations

import argparse
import sys
import time
import timeit
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]


def cpu_us(fn: Callable[[], Any], number: int = 2000) -> float:
    """Microseconds of thread CPU time per call of ``fn``: the third lowest of 9 repeats."""
    return sorted(timeit.repeat(fn, number=number, repeat=9, timer=time.thread_time))[2] / number * 1e6


def pieces() -> dict[str, float]:
    import torch
    from torch import nn

    from lightning_pipe.models.plain import call_with_activation
    from lightning_pipe.step import sharing
    from lightning_pipe.step.interception import Call
    from lightning_pipe.step.protocol import Outcome, _weighted_mean
    from lightning_pipe.step.sharing import _pack_values, flatten
    from lightning_pipe.step.stage import StageModule, StepContext

    torch.set_num_threads(1)
    body = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    received, data = torch.ones(4, 64, requires_grad=True), torch.ones(4, 64)
    step = StepContext([Call((data,), {})] * 16, [4] * 16)
    last = StageModule(body, 1, 2, call_with_activation)
    first = StageModule(body, 0, 2, call_with_activation)
    last.step = first.step = step  # (a tree before the step was a module attribute takes `step=`: see `_forward`)
    loss = torch.tensor(0.5)
    outcome = Outcome(loss=loss, output=loss, output_shared=True, key_checksum=12345)
    schema, values = flatten(outcome)
    flat = _pack_values(values, torch.device("cpu"), flag=1.0)[1:]
    return {
        "last stage's forward around its body, per microbatch": cpu_us(_forward(last, step, received))
        - cpu_us(lambda: body(received)),
        "first stage's forward around its body, per microbatch": cpu_us(_forward(first, step))
        - cpu_us(lambda: body(data)),
        "outcome encoded (last stage), per step": cpu_us(lambda: flatten(outcome)),
        "outcome decoded (other ranks), per step": cpu_us(_decoding(sharing, schema, flat)),
        "step loss of one microbatch, per step": cpu_us(lambda: _weighted_mean([loss], [64.0])),
    }


def _forward(stage: Any, step: Any, *received: Any) -> Callable[[], Any]:
    """A call of ``stage``'s forward on microbatch 3: the step from the module, or (a tree where the stage took it
    as a keyword) as ``step=``."""
    import inspect

    if "step" in inspect.signature(stage.forward).parameters:
        return lambda: stage(*received, step=step, microbatch=3)
    return lambda: stage(*received, microbatch=3)


def _decoding(sharing: Any, schema: Any, flat: Any) -> Callable[[], Any]:
    """The other ranks' decoding of one step's values: through the channel's decoder, made once per schema, where the
    tree has one (``sharing._decoder``), else ``sharing.rebuild``."""
    import torch

    cpu = torch.device("cpu")
    if hasattr(sharing, "_decoder"):
        decode = sharing._decoder(schema)
        return lambda: decode(sharing._Reader(flat, 0, cpu, sharing._numbers(flat)))
    return lambda: sharing.rebuild(schema, flat, cpu)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose lightning_pipe is measured")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.tree.resolve()))
    for name, us in pieces().items():
        print(f"{us:8.2f} us  {name}")


if __name__ == "__main__":
    main()
