"""How a stage is called: each frontend's *stage call*, which runs a stage body on one microbatch.

A stage call is ``stage_call(body, args, kwargs, received, is_first, is_last) -> output``: ``args``/``kwargs`` are the
microbatch's own network call (every rank captured it), ``received`` the activation tensors the previous stage sent
(``None`` on the first stage). The split chooses the call with the frontend (:mod:`lightning_pipe.split.builder`);
the step layer's stage adapter invokes it. A stage call may also tell the adapter that a stage must run whole
backward passes in the split-backward schedules (``full_backward(stage) -> bool``, see
:class:`~lightning_pipe.split.dataflow.DataflowCall`).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Union

from torch import nn

from lightning_pipe.errors import PipelineUsageError

#: ``stage_call(body, args, kwargs, received, is_first, is_last) -> output``
StageCall = Callable[[nn.Module, tuple, dict, Union[tuple, None], bool, bool], Any]


def _first_parameter(body: nn.Module) -> str | None:
    params = [
        p
        for p in inspect.signature(type(body).forward).parameters.values()
        if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    return params[0].name if params else None


def activation_argument(body: nn.Module, args: tuple, count: int) -> str:
    """How the received activation enters a call with positional ``args``, for messages: the argument(s) it
    replaces."""
    if args:
        names = [p.name for p in inspect.signature(type(body).forward).parameters.values() if p.name != "self"][:count]
        return ", ".join(f"`{n}`" for n in names) or "the first argument"
    return f"`{_first_parameter(body)}`"


def call_with_activation(
    body: nn.Module, args: tuple, kwargs: dict, received: tuple | None, is_first: bool, is_last: bool
) -> Any:
    """The stage call of ordinary networks (``frontend="modules"``): the network's own forward, on later stages with
    the activation in place of the network's first input.

    A stage that returned ``k`` tensors fills the first ``k`` positional arguments; a call made by keyword gets the
    activation in the keyword of the forward's first parameter. Every other argument is the microbatch's own.
    """
    if received is not None:
        if args:
            args = tuple(received) + tuple(args[len(received) :])
        else:
            name = _first_parameter(body)
            if name is None or name not in kwargs or len(received) != 1:
                raise PipelineUsageError(
                    f"{type(body).__name__} was called with keyword arguments {sorted(kwargs)} only, and the stage"
                    f" received {len(received)} activation tensor(s) from the previous stage: the activation takes the"
                    " place of the forward's first parameter, which must be one of them (and a single tensor). Pass"
                    " the network's input positionally, or first."
                )
            kwargs = {**kwargs, name: received[0]}
    return body(*args, **kwargs)


def call_traced(
    body: nn.Module, args: tuple, kwargs: dict, received: tuple | None, is_first: bool, is_last: bool
) -> Any:
    """The stage call of traced stages: the first takes the network's call, later ones what the stage before sent
    (values a later stage needs from the network's input are threaded through the stages in between)."""
    return body(*args, **kwargs) if received is None else body(*received)
