"""The stage call of ``frontend="trace"``: torch's tracer cut the network into stage graphs, whatever its kind.

A stage call is a :data:`~lightning_pipe.models.base.StageCall`; the default frontend takes the model kind's
(:mod:`lightning_pipe.models`), the dataflow frontend its own (:class:`~lightning_pipe.split.dataflow.DataflowCall`).
"""

from __future__ import annotations

from typing import Any

from torch import nn


def call_traced(
    body: nn.Module, args: tuple, kwargs: dict, received: tuple | None, is_first: bool, is_last: bool
) -> Any:
    """The stage call of traced stages: the first takes the network's call, later ones what the stage before sent
    (values a later stage needs from the network's input are threaded through the stages in between)."""
    return body(*args, **kwargs) if received is None else body(*received)
