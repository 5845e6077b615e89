"""``frontend="auto"``: which frontend cuts a network, chosen per network before the cut.

The modules frontend is the cheaper one (each stage runs its units and the glue around them once, on real
activations), but it runs the network's own forward with the units other stages hold removed and the previous
stage's activation in place of the input: that works for an ``nn.Sequential``, for a model kind with its own stage
entry (transformers models), and for a forward written for it (``if self.embed is not None``). Any other forward
(positions computed from its input, a reshape of its input, units called unconditionally) fails on a stage after the
first. The dataflow frontend runs every forward unchanged, so it is chosen for those. Pure: no process group.
"""

from __future__ import annotations

import inspect
import re

from torch import nn

from lightning_pipe.models import kind_of
from lightning_pipe.models.plain import PlainKind
from lightning_pipe.models.units import is_one_unit

#: a forward written for the modules frontend tests its units against None (``self.head is not None``)
_NONE_CHECK = re.compile(r"\bself\.(\w+)\s+is\s+(?:not\s+)?None\b")


def _forward_skips_absent_units(network: nn.Module) -> bool:
    try:
        source = inspect.getsource(type(network).forward)
    except (OSError, TypeError):  # defined outside a file (an interactive session): cannot tell
        return False
    children = {name for name, _ in network.named_children()}
    return any(match in children for match in _NONE_CHECK.findall(source))


def _runs_only_unchanged(network: nn.Module) -> bool:
    """Whether ``network`` is a plain module whose forward shows no sign of skipping absent units."""
    if type(network).forward is nn.Sequential.forward or not isinstance(kind_of(network), PlainKind):
        return False
    return not _forward_skips_absent_units(network)


def choose_frontend(network: nn.Module, frontend: str, tensor_parallel: int, several_stacks: bool) -> tuple[str, str]:
    """The frontend for ``network`` and why, for the ``frontend`` setting (``"auto"`` is resolved here)."""
    name = type(network).__name__
    if frontend != "auto":
        return frontend, f"`frontend={frontend!r}` was given"
    if several_stacks:
        return "dataflow", "`blocks` names several block stacks, which only the dataflow frontend pipelines"
    if is_one_unit(network):
        return "modules", (
            f"{name} is one module with no submodules: the first stage runs it whole, the others pass its output on"
        )
    if tensor_parallel > 1:
        why = f"`tensor_parallel={tensor_parallel}` needs the modules frontend"
        if _runs_only_unchanged(network):
            why += (
                f" (the dataflow frontend, which runs a forward unchanged, does not take tensor parallelism), so"
                f" {name}.forward must skip the units other stages hold (`if self.embed is not None:`) and take the"
                " previous stage's activation as its input; it tests none of its units against None"
            )
        return "modules", why
    if type(network).forward is nn.Sequential.forward:
        return "modules", f"{name} is an nn.Sequential: its forward runs whatever units a stage holds"
    kind = kind_of(network)
    if not isinstance(kind, PlainKind):
        return "modules", f"{name} is a {kind.name}: each stage enters its forward where its units start"
    if _forward_skips_absent_units(network):
        return "modules", f"{name}.forward tests its units against None, so it skips the units a stage does not hold"
    return "dataflow", (
        f"{name}.forward calls its units without None checks, so it runs unchanged on every stage, with the units"
        " other stages hold standing in (pass `frontend='modules'` for a forward that skips absent units and takes"
        " the previous stage's activation as input: it is cheaper)"
    )
