"""How the units of an ordinary network are found: its block stack(s) and the modules around them.

A *unit* is what a stage holds whole: a block of the block stack, or a module before it (``pre``) or after it
(``post``). A :class:`Layout` lists them in execution order; every model kind (:mod:`lightning_pipe.models`) returns
one. Pure: names and module trees only.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from lightning_pipe.compat.torchmetrics import is_metric_container
from lightning_pipe.errors import PipelineModelError

#: Containers whose entries can be a block stack.
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass(frozen=True)
class Layout:
    """The units of a network in execution order, as names relative to the pipelined module.

    ``pre`` run before the block stack and always go to the first stage, ``post`` run after it and go to the last
    stage; ``blocks`` are the entries of the block stack that the stages share out. A network with several block
    stacks (an encoder and a decoder: ``frontend="dataflow"``) has its stacks' blocks in order, and ``between`` the
    units that run between two stacks (an encoder's final norm): ``(block, units)``, the units placed with the block
    they follow. ``together``: ranges of block indices, first and last included, that one stage should hold whole
    (layers that read an earlier layer's keys and values: Gemma 3n's and Gemma 4's ``num_kv_shared_layers``); the
    balanced splits keep them together where the stage count allows.
    """

    pre: tuple[str, ...]
    blocks: tuple[str, ...]
    post: tuple[str, ...]
    between: tuple[tuple[str, tuple[str, ...]], ...] = ()
    together: tuple[tuple[int, int], ...] = ()

    @functools.cached_property
    def _after(self) -> dict[str, tuple[str, ...]]:
        return dict(self.between)

    def group(self, block: str) -> tuple[str, ...]:
        """``block`` and the units placed with it."""
        return (block, *self._after.get(block, ()))

    @property
    def units(self) -> tuple[str, ...]:
        return self.pre + tuple(u for b in self.blocks for u in self.group(b)) + self.post


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _holds_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def is_one_unit(module: nn.Module) -> bool:
    """Whether ``module`` is a single unit: no submodules (Lightning's demos' one ``nn.Linear``), parameters of its
    own. Its forward is the unit's, so nothing of it lies outside the unit."""
    return not isinstance(module, CONTAINERS) and not any(module.children()) and _holds_state(module)


#: the layout of a network that is one unit: the network itself (the name ``""``), as a single block
ONE_UNIT = Layout(pre=(), blocks=("",), post=())


def find_block_stack(module: nn.Module, blocks: str = "auto") -> str:
    """Return the name of the container whose entries are the pipeline's blocks.

    ``"auto"``: the module itself if it is an ``nn.Sequential``; otherwise the ``nn.ModuleList``/``nn.ModuleDict``/
    ``nn.Sequential`` of at least two entries of one class that holds the most parameters (the shallowest on a tie),
    or, if no container has entries of one class, the container holding the most parameters.
    """
    if blocks != "auto":
        try:
            found = module.get_submodule(blocks) if blocks else module
        except AttributeError:
            raise PipelineModelError(
                f"`blocks={blocks!r}` names no submodule of {type(module).__name__}. Pass the name of the"
                " nn.ModuleList/nn.ModuleDict/nn.Sequential that holds the repeated blocks, or `blocks='auto'`."
            ) from None
        if not isinstance(found, CONTAINERS):
            raise PipelineModelError(
                f"`blocks={blocks!r}` is a {type(found).__name__}, not an nn.ModuleList, nn.ModuleDict or"
                " nn.Sequential. Point `blocks` at the container of the repeated blocks."
            )
        return blocks
    if isinstance(module, nn.Sequential):
        return ""
    candidates = [
        (name, sub)
        for name, sub in module.named_modules()
        if isinstance(sub, CONTAINERS) and len(sub) >= 2 and not is_metric_container(sub)
    ]
    if not candidates and is_one_unit(module):
        # Lightning's BoringModel and DemoModel: one Linear. Only the modules frontend runs it (find_layout).
        raise PipelineModelError(
            f"The network is a single {type(module).__name__} with no submodules: it has no block stack to cut"
            " between stages (the dataflow and trace frontends cut there). Use `frontend='modules'` (what"
            " `frontend='auto'` picks for it): the first stage runs it whole and the others pass its output on;"
            " better, train it with `devices=1` (or data parallelism, `strategy='ddp'`)."
        )
    stacked = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.RNNBase) and m.num_layers > 1]
    if not candidates and stacked:
        # Lightning's demo LightningLSTM: its four layers are one nn.LSTM, which runs them all in one call.
        name, rnn = stacked[0]
        raise PipelineModelError(
            f"{type(module).__name__}'s repeated layers are inside one {type(rnn).__name__} (`{name}`,"
            f" num_layers={rnn.num_layers}), which runs them all in one call: a pipeline cuts only between modules."
            f" Build them as an nn.ModuleList of one-layer {type(rnn).__name__} modules, each passing its output"
            " (and its slice of the state) on, or train this network with `devices=1` (or data parallelism,"
            " `strategy='ddp'`)."
        )
    if not candidates:
        raise PipelineModelError(
            f"{type(module).__name__} has no splittable block stack: pipelining needs the network's repeated blocks"
            " in an nn.ModuleList, nn.ModuleDict or nn.Sequential with at least two entries (or an nn.Sequential"
            " network). Put the blocks in such a container, or use `frontend='trace'` with `example_input_array`."
        )
    # Repeated blocks share one class; a container of mixed parts (litgpt's `transformer` dict of wte/h/ln_f) is not
    # the stack even when it holds more parameters.
    uniform = [(n, c) for n, c in candidates if len({type(m) for m in c.children()}) == 1]
    name, _ = max(uniform or candidates, key=lambda c: (_param_count(c[1]), -c[0].count("."), -len(c[0])))
    return name


def find_layout(module: nn.Module, blocks: str = "auto") -> Layout:
    """Split a network into pre-units, blocks and post-units, each in definition order.

    The units around the block stack are the siblings of the stack and of each of its ancestors: those defined
    before the path to the stack run first, those after it run last. torchmetrics children are never units.
    """
    if blocks == "auto" and is_one_unit(module):
        return ONE_UNIT
    stack = find_block_stack(module, blocks)
    container = module.get_submodule(stack) if stack else module
    prefix = f"{stack}." if stack else ""
    block_names = tuple(prefix + name for name, child in container.named_children() if not is_metric_container(child))
    pre: list[str] = []
    post: list[str] = []
    parts = stack.split(".") if stack else []
    parent = module
    path = ""
    for part in parts:
        seen_path = False
        for name, child in parent.named_children():
            if name == part:
                seen_path = True
                continue
            if is_metric_container(child) or not _holds_state(child):
                # Stateless children (dropout, activations, loss modules) stay on every stage.
                continue
            (post if seen_path else pre).append(path + name)
        parent = parent.get_submodule(part)
        path += part + "."
    # Units nearer the stack run closer to it: an outer "pre" runs before an inner "pre", an outer "post" after.
    post_ordered = _order_post(post)
    return Layout(pre=tuple(pre), blocks=block_names, post=tuple(post_ordered))


def find_stacks(module: nn.Module, blocks: str | Sequence[str] = "auto") -> list[str]:
    """The containers whose entries are the pipeline's blocks when a network may have several stacks
    (``frontend="dataflow"``: an encoder's and a decoder's layers, a U-Net's down and up blocks), in definition order.

    ``"auto"``: every ``nn.ModuleList``/``nn.ModuleDict``/``nn.Sequential`` of at least two entries of one class that
    hold parameters and that no other such container holds; the network itself if it is an ``nn.Sequential``; else
    ``find_block_stack``'s choice. A name or a list of names picks the containers.
    """
    if not isinstance(blocks, str):
        names = [find_block_stack(module, name) for name in blocks]
        nested = [(a, b) for a in names for b in names if a != b and (not b or a.startswith(b + "."))]
        if len(set(names)) != len(names) or nested:
            raise PipelineModelError(
                f"`blocks={list(blocks)}` names a container twice or one inside another"
                f"{f' ({nested[0][0]!r} in {nested[0][1]!r})' if nested else ''}. Name each block stack once."
            )
        order = {name: i for i, (name, _) in enumerate(module.named_modules())}
        return sorted(names, key=order.__getitem__)
    if blocks != "auto" or isinstance(module, nn.Sequential):
        return [find_block_stack(module, blocks)]
    uniform = [
        name
        for name, sub in module.named_modules()
        if isinstance(sub, CONTAINERS)
        and len(sub) >= 2
        and not is_metric_container(sub)
        and len({type(m) for m in sub.children()}) == 1
        and all(_param_count(m) > 0 for m in sub.children())
    ]
    outer = [name for name in uniform if not any(name.startswith(other + ".") for other in uniform)]
    return outer or [find_block_stack(module, "auto")]


def find_stacks_layout(module: nn.Module, stacks: Sequence[str]) -> Layout:
    """The units of a network with one or more block stacks, in definition order (:func:`ordered_layout`). Units are
    the children with parameters or buffers that hold no stack, on the paths to the stacks."""
    stack_set = set(stacks)
    on_path = {name.rsplit(".", i)[0] for name in stacks for i in range(1, name.count(".") + 1)} | {""}
    order: list[str] = []

    def walk(parent: nn.Module, prefix: str) -> None:
        for key, child in parent.named_children():
            name = prefix + key
            if is_metric_container(child):
                continue
            if name in on_path and name not in stack_set:
                walk(child, name + ".")
            elif name in stack_set or _holds_state(child):
                order.append(name)

    walk(module, "") if "" not in stack_set else order.append("")
    return ordered_layout(module, order, stack_set)


def ordered_layout(module: nn.Module, order: Sequence[str], stacks: set[str]) -> Layout:
    """The layout of units and block stacks listed in execution order: the stacks' blocks, the units before the
    first stack (``pre``), after the last (``post``) and between two (placed with the block they follow).

    A module reachable under two names (T5's encoder and decoder ``embed_tokens`` are its ``shared`` embedding) is
    one unit: its other names are placed where the first one is.
    """
    last_stack = max(i for i, name in enumerate(order) if name in stacks)
    pre: list[str] = []
    blocks: list[str] = []
    post: list[str] = []
    between: dict[str, list[str]] = {}
    group_of: dict[int, list[str]] = {}
    for i, name in enumerate(order):
        child = module.get_submodule(name) if name else module
        if name in stacks:
            prefix = f"{name}." if name else ""
            blocks += [prefix + k for k, entry in child.named_children() if not is_metric_container(entry)]
            continue
        group = pre if not blocks else post if i > last_stack else between.setdefault(blocks[-1], [])
        group_of.setdefault(id(child), group).append(name)
    return Layout(
        pre=tuple(pre), blocks=tuple(blocks), post=tuple(post), between=tuple((b, tuple(u)) for b, u in between.items())
    )


def _order_post(post: list[str]) -> list[str]:
    # Collected outer level first; post-units of inner levels run before those of outer levels.
    by_depth: dict[int, list[str]] = {}
    for name in post:
        by_depth.setdefault(name.count("."), []).append(name)
    return [name for depth in sorted(by_depth, reverse=True) for name in by_depth[depth]]
