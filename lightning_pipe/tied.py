"""Tied parameters: one Parameter reachable under several names, such as an output head sharing the input embedding.

After the split each stage holding one of those names holds its own copy, so their gradients must be summed across
stages before the optimizer step. This module only finds the groups; it needs no process group.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def tied_groups(network: nn.Module, units: Sequence[str] | None = None) -> list[list[str]]:
    """The names of each parameter that ``network`` reaches under several names, in definition order.

    With ``units`` (unit names, as in ``Layout.units``), only groups whose names fall in at least two different units
    are returned: sharing inside one unit stays on one stage and needs no summing.
    """
    names: dict[int, list[str]] = {}
    for name, param in network.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    groups = [group for group in names.values() if len(group) > 1]
    if units is None:
        return groups
    return [group for group in groups if len({_unit_of(name, units) for name in group}) > 1]


def _unit_of(name: str, units: Sequence[str]) -> str | None:
    return next((unit for unit in units if name.startswith(unit + ".")), None)
