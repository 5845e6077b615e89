"""Ordinary networks (any ``nn.Module``): units found from the module tree, the network's own forward on every stage.

The default frontend removes other stages' units (``None``, or deleted from their container), so the forward must
skip units that are ``None`` (an ``nn.Sequential`` needs no change); a later stage takes the activation in place of
the network's first input (:func:`call_with_activation`). No tensor-parallel plan of its own, names on disk the
network's own.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch import nn

from lightning_pipe.errors import PipelineUsageError
from lightning_pipe.models.base import Placeholder
from lightning_pipe.models.units import Layout, find_layout


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


class PlainKind:
    """Any ``nn.Module`` no other kind claims (:class:`~lightning_pipe.models.base.ModelKind`)."""

    name = "plain module"
    stage_call = staticmethod(call_with_activation)
    prepare_dataflow_call = None
    prepare_profile_call = None

    def layout(self, network: nn.Module, blocks: str = "auto") -> Layout:
        return find_layout(network, blocks)

    def dataflow_order(self, network: nn.Module) -> list[str] | None:
        return None

    def placeholder(self, network: nn.Module) -> Placeholder | None:
        return None

    def tensor_parallel_plan(
        self, network: nn.Module, tensor_parallel: int, shared: Sequence[tuple[str, ...]] = ()
    ) -> dict[str, str] | None:
        return None

    def disk_names(self, network: nn.Module, name: str) -> Iterator[str]:
        yield name

    def ignored_on_load(self, network: nn.Module) -> tuple[list[str], list[str]]:
        return [], []

    def new_weights(
        self, network: nn.Module, classes: Sequence[str], missing: Iterable[str], stored: Iterable[str]
    ) -> tuple[set[str], set[str]]:
        return set(), set()

    def directory_type(self, network: nn.Module) -> str | None:
        return None

    def record(self, network: nn.Module, attribute: str) -> dict[str, Any] | None:
        return None

    def restore_buffers(self, module: nn.Module) -> bool:
        return False

    def decoding(self) -> None:
        return None  # a decoding loop of the user's own calls the network once per token: refused as such

    def state_dict_adapter(self) -> None:
        return None
