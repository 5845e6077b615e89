"""Pure functions that decide which parts of a network go to which pipeline stage and rank.

Nothing here touches a process group or allocates parameters: every function works on module names, counts and
configuration values, so the splitting logic is unit-tested on its own.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from lightning_pipe.compat.torchmetrics import is_metric_container
from lightning_pipe.errors import PipelineConfigError, PipelineModelError

#: Containers whose entries can be a block stack.
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass(frozen=True)
class Layout:
    """The units of a network in execution order, as names relative to the pipelined module.

    ``pre`` run before the block stack and always go to the first stage, ``post`` run after it and go to the last
    stage; ``blocks`` are the entries of the block stack that the stages share out. A network with several block
    stacks (an encoder and a decoder: ``frontend="dataflow"``) has its stacks' blocks in order, and ``between`` the
    units that run between two stacks (an encoder's final norm): ``(block, units)``, the units placed with the block
    they follow.
    """

    pre: tuple[str, ...]
    blocks: tuple[str, ...]
    post: tuple[str, ...]
    between: tuple[tuple[str, tuple[str, ...]], ...] = ()

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


def too_few_blocks(num_blocks: int, num_stages: int) -> PipelineConfigError:
    return PipelineConfigError(
        f"The model has {num_blocks} blocks but the pipeline needs {num_stages} stages: every stage needs at"
        " least one block. Use fewer stages (`pipeline_size`/`stages_per_rank`) or a model with more blocks."
    )


def balance_blocks(num_blocks: int, num_stages: int) -> list[int]:
    """Blocks per stage for an even split; the first ``num_blocks % num_stages`` stages get one more."""
    if num_stages < 1:
        raise PipelineConfigError(f"The number of stages must be at least 1, got {num_stages}.")
    if num_blocks < num_stages:
        raise too_few_blocks(num_blocks, num_stages)
    base, extra = divmod(num_blocks, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


def counts_from_split_points(blocks: Sequence[str], split_points: Sequence[str], num_stages: int) -> list[int]:
    """Blocks per stage from the names of the blocks at which stages 1..N-1 begin."""
    if len(split_points) != num_stages - 1:
        raise PipelineConfigError(
            f"`split_points` has {len(split_points)} entries but {num_stages} stages need {num_stages - 1}"
            " (the first block of every stage but the first)."
        )
    index = {name: i for i, name in enumerate(blocks)}
    starts = [0]
    for point in split_points:
        if point not in index:
            raise PipelineConfigError(
                f"`split_points` entry {point!r} is not a block of the model. Blocks are: {_preview(blocks)}."
            )
        starts.append(index[point])
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise PipelineConfigError(
            f"`split_points={list(split_points)}` must name distinct blocks in model order, after the first block."
        )
    starts.append(len(blocks))
    return [b - a for a, b in zip(starts, starts[1:])]


def check_balance(balance: Sequence[int], num_blocks: int, num_stages: int) -> list[int]:
    """Validate an explicit blocks-per-stage list."""
    balance = list(balance)
    if len(balance) != num_stages:
        raise PipelineConfigError(
            f"`balance={balance}` has {len(balance)} entries but the pipeline has {num_stages} stages."
        )
    if any(n < 1 for n in balance):
        raise PipelineConfigError(f"`balance={balance}` gives a stage no blocks; every entry must be at least 1.")
    if sum(balance) != num_blocks:
        raise PipelineConfigError(f"`balance={balance}` sums to {sum(balance)} but the model has {num_blocks} blocks.")
    return balance


def stage_units(layout: Layout, counts: Sequence[int]) -> list[tuple[str, ...]]:
    """The units of each stage: pre-units on the first stage, post-units on the last, blocks by ``counts``."""
    stages: list[tuple[str, ...]] = []
    start = 0
    for i, n in enumerate(counts):
        units = tuple(u for b in layout.blocks[start : start + n] for u in layout.group(b))
        if i == 0:
            units = layout.pre + units
        if i == len(counts) - 1:
            units = units + layout.post
        stages.append(units)
        start += n
    return stages


def stage_to_rank(num_stages: int, pipeline_size: int, style: str) -> list[int]:
    """The pipeline rank that holds each stage: round robin (``"loop"``) or there and back (``"v"``)."""
    if style == "loop":
        return [s % pipeline_size for s in range(num_stages)]
    if style == "v":
        return [
            s % pipeline_size if (s // pipeline_size) % 2 == 0 else pipeline_size - 1 - s % pipeline_size
            for s in range(num_stages)
        ]
    raise ValueError(f"Unknown placement style {style!r}.")


def _preview(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


@dataclass(frozen=True)
class UnitCosts:
    """One cost per unit: the pre-units' total (pinned to the first stage), each block's, the post-units' total."""

    pre: float
    blocks: tuple[float, ...]
    post: float

    def stages(self, counts: Sequence[int]) -> list[float]:
        """The cost of each stage of a split into ``counts`` blocks per stage."""
        sums = [0.0]
        for cost in self.blocks:
            sums.append(sums[-1] + cost)
        out, start = [], 0
        for i, n in enumerate(counts):
            cost = sums[start + n] - sums[start]
            cost += self.pre if i == 0 else 0.0
            cost += self.post if i == len(counts) - 1 else 0.0
            out.append(cost)
            start += n
        return out


def balance_by_cost(
    costs: UnitCosts,
    num_stages: int,
    *,
    memory: UnitCosts | None = None,
    memory_limit: float | None = None,
    empty_ends: bool = True,
) -> list[int]:
    """Blocks per stage minimising the largest stage cost, exactly (dynamic programming over contiguous splits).

    Every stage holds at least one block, except that with ``empty_ends`` the first stage may hold none when there
    are pre-units and the last none when there are post-units (a heavy head can be a stage on its own): such a
    stage still runs real work. With ``memory`` and ``memory_limit``, splits with a stage whose memory exceeds the
    limit are excluded. Among the splits with the smallest largest cost, the one with the smallest sum of squared
    stage costs is taken (the other stages are balanced too); on a tie there, earlier stages hold more blocks.
    """
    n = len(costs.blocks)
    fewest = _fewest_blocks(costs, num_stages, empty_ends)
    if n < sum(fewest):
        raise too_few_blocks(n, num_stages)
    stage = _stage_cost(costs, num_stages, memory, memory_limit)
    bottleneck, _ = _split_dp(n, fewest, stage, max)
    if bottleneck == float("inf"):
        raise PipelineConfigError(
            f"No split of the {n} blocks into {num_stages} stages fits `memory_limit={memory_limit}` bytes per"
            " stage. Use more stages, activation checkpointing, fewer microbatches in flight, or a larger limit."
        )
    cap = bottleneck * (1 + 1e-9)
    return _split_dp(n, fewest, stage, lambda total, c: total + c * c if c <= cap else float("inf"))[1]


def balance_step_time(
    per_microbatch: UnitCosts,
    update: UnitCosts,
    num_stages: int,
    microbatches: int,
    *,
    memory: UnitCosts | None = None,
    memory_limit: float | None = None,
    empty_ends: bool = True,
) -> list[int]:
    """Blocks per stage minimising the step time of a flush schedule (GPipe, 1F1B), exactly.

    With ``M`` microbatches such a step takes one pass of a microbatch through every stage (the same for every
    split), plus ``M - 1`` times the slowest stage's forward+backward of a microbatch (``per_microbatch``), plus the
    first stage's optimizer step (``update``): it finishes the last backward, so nothing hides its step, while the
    other stages' steps overlap the backwards still running before them. Among the splits with the smallest step
    time, the later stages are balanced as in :func:`balance_by_cost`. Blocks per stage, ``empty_ends`` and
    ``memory_limit`` as in :func:`balance_by_cost`.
    """
    n = len(per_microbatch.blocks)
    fewest = _fewest_blocks(per_microbatch, num_stages, empty_ends)
    if n < sum(fewest):
        return balance_by_cost(per_microbatch, num_stages, empty_ends=empty_ends)  # raises the usual error
    if num_stages == 1:
        return [n]
    stage = _stage_cost(per_microbatch, num_stages, memory, memory_limit)
    first_update = list(itertools.accumulate(update.blocks, initial=update.pre))
    inf = float("inf")
    # rest[s][i]: the smallest bottleneck of stages s..K-1 holding blocks i..n-1.
    rest = [[inf] * (n + 1) for _ in range(num_stages)]
    for i in range(n - fewest[-1] + 1):
        rest[-1][i] = stage(num_stages - 1, i, n)
    for s in range(num_stages - 2, 0, -1):
        for i in range(n + 1):
            for j in range(i + fewest[s], n + 1):
                rest[s][i] = min(rest[s][i], max(stage(s, i, j), rest[s + 1][j]))
    best, first = inf, 0
    for j in range(n, fewest[0] - 1, -1):  # later cuts first: on a tie the first stage holds more blocks
        step = (microbatches - 1) * max(stage(0, 0, j), rest[1][j]) + first_update[j]
        if step < best:
            best, first = step, j
    if best == inf:
        raise PipelineConfigError(
            f"No split of the {n} blocks into {num_stages} stages fits `memory_limit={memory_limit}` bytes per"
            " stage. Use more stages, activation checkpointing, fewer microbatches in flight, or a larger limit."
        )
    cap = max(stage(0, 0, first), rest[1][first]) * (1 + 1e-9)

    def tail(s: int, i: int, j: int) -> float:
        return stage(s + 1, first + i, first + j)

    squares = _split_dp(n - first, fewest[1:], tail, lambda total, c: total + c * c if c <= cap else inf)[1]
    return [first, *squares]


def _split_dp(
    n: int, fewest: list[int], stage: Callable[[int, int, int], float], combine: Callable[[float, float], float]
) -> tuple[float, list[int]]:
    """Minimise ``combine`` folded over the stages' costs (``max``: the bottleneck; a sum: a total) over contiguous
    splits of ``n`` blocks; return the minimum and its blocks per stage."""
    k = len(fewest)
    inf = float("inf")
    # best[s][j]: the minimum over stages 0..s holding blocks 0..j; cut[s][j]: where stage s then begins.
    best = [[inf] * (n + 1) for _ in range(k)]
    cut = [[0] * (n + 1) for _ in range(k)]
    for j in range(fewest[0], n + 1):
        best[0][j] = combine(0.0, stage(0, 0, j))
    for s in range(1, k):
        for j in range(n + 1):
            # Scanning later cuts first and keeping only strict improvements favours longer earlier stages on ties.
            for i in range(j - fewest[s], -1, -1):
                value = combine(best[s - 1][i], stage(s, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    counts, j = [], n
    for s in range(k - 1, 0, -1):
        counts.append(j - cut[s][j])
        j = cut[s][j]
    return best[-1][n], [j, *counts[::-1]]


def _fewest_blocks(costs: UnitCosts, num_stages: int, empty_ends: bool) -> list[int]:
    if num_stages < 1:
        raise PipelineConfigError(f"The number of stages must be at least 1, got {num_stages}.")
    fewest = [1] * num_stages
    if empty_ends and num_stages > 1:
        fewest[0] = 0 if costs.pre > 0 else 1
        fewest[-1] = 0 if costs.post > 0 else 1
    return fewest


def _stage_cost(
    costs: UnitCosts, num_stages: int, memory: UnitCosts | None, memory_limit: float | None
) -> Callable[[int, int, int], float]:
    """``stage(s, i, j)``: the cost of stage ``s`` holding blocks ``i:j``, infinite when over the memory limit."""
    prefix = list(itertools.accumulate(costs.blocks, initial=0.0))
    mem_prefix = list(itertools.accumulate(memory.blocks, initial=0.0)) if memory is not None else []

    def stage(s: int, i: int, j: int) -> float:
        first, last = s == 0, s == num_stages - 1
        if memory is not None and memory_limit is not None:
            used = mem_prefix[j] - mem_prefix[i] + (memory.pre if first else 0) + (memory.post if last else 0)
            if used > memory_limit:
                return float("inf")
        return prefix[j] - prefix[i] + (costs.pre if first else 0.0) + (costs.post if last else 0.0)

    return stage


def all_splits(num_blocks: int, num_stages: int, *, first_min: int = 1, last_min: int = 1) -> list[list[int]]:
    """Every blocks-per-stage split (for exhaustive search in tests and benchmarks), in lexicographic order."""
    if num_stages == 1:
        return [[num_blocks]] if num_blocks >= max(first_min, last_min) else []
    out = []
    rest_min = last_min + max(num_stages - 2, 0)
    for head in range(first_min, num_blocks - rest_min + 1):
        for tail in all_splits(
            num_blocks - head, num_stages - 1, first_min=1 if num_stages > 2 else last_min, last_min=last_min
        ):
            out.append([head, *tail])
    return out


def unit_params(module: nn.Module, layout: Layout) -> UnitCosts:
    """Parameter counts per unit (works on the meta device): the cost behind ``balance="params"``."""

    def count(names: Sequence[str]) -> float:
        # Unique parameters: a module reachable under two names (T5's shared embedding) counts once.
        params = {id(p): p for u in names for p in module.get_submodule(u).parameters()}
        return float(sum(p.numel() for p in params.values()))

    return UnitCosts(
        pre=count(layout.pre), blocks=tuple(count(layout.group(b)) for b in layout.blocks), post=count(layout.post)
    )
