"""Tied parameters: one Parameter reachable under several names, such as an output head sharing the input embedding.

After the split each stage holding one of those names holds its own copy, so their gradients must be summed across
stages before the optimizer step. This module only finds the groups; it needs no process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def retie(network: nn.Module, groups: Sequence[Sequence[str]]) -> None:
    """Make each group's names one Parameter again, the first name's (``to_empty`` of a meta-device network gives
    every name its own tensor; sharing inside a stage must survive it, as it would on one device)."""
    for first, *others in groups:
        param = network.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(network.get_submodule(owner) if owner else network, attr, param)


def _unit_of(name: str, units: Sequence[str]) -> str | None:
    return next((unit for unit in units if name.startswith(unit + ".")), None)


@dataclass(frozen=True)
class Tie:
    """A parameter shared by units of several stages."""

    #: every name of the parameter in the network, in definition order; the first is the one checkpoints use
    names: tuple[str, ...]
    #: the stages holding one of the names, ascending
    stages: tuple[int, ...]

    @property
    def canonical(self) -> str:
        return self.names[0]


def plan_ties(network: nn.Module, units: Sequence[str], units_per_stage: Sequence[Sequence[str]]) -> list[Tie]:
    """The parameters that units of different stages share (pure: names and stage lists only)."""
    stage_of_unit = {u: s for s, us in enumerate(units_per_stage) for u in us}
    ties = []
    for group in tied_groups(network, units):
        stages = sorted({stage_of_unit[u] for u in (_unit_of(n, units) for n in group) if u in stage_of_unit})
        if len(stages) > 1:
            ties.append(Tie(tuple(group), tuple(stages)))
    return ties


def aliases(groups: Sequence[Sequence[str]], prefix: str = "") -> dict[str, str]:
    """``{other name: first name}`` of every group of names of one parameter (a :class:`Tie`'s ``names``, or every
    group of :func:`tied_groups`), with ``prefix`` (the network's attribute) on both."""
    return {prefix + name: prefix + names[0] for names in groups for name in names[1:]}
