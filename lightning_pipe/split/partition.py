"""Pure functions that decide which parts of a network go to which pipeline stage and rank.

Nothing here touches a process group or allocates parameters: every function works on module names, counts and
configuration values, so the splitting logic is unit-tested on its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.models.units import Layout
from lightning_pipe.schedules.custom import stage_to_rank as stage_to_rank
from lightning_pipe.settings import PipelineSettings


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


def keep_together(counts: Sequence[int], together: Sequence[tuple[int, int]]) -> list[int]:
    """``counts`` (blocks per stage) with each cut that falls inside one of the ``together`` ranges (first and last
    block index, included) moved to the nearer end of the range. Where the cuts on that side are in the way, the
    blocks on that side are spread evenly over their stages again; a cut that cannot move (too few blocks outside the
    range for the stages) stays, and the stage call refuses the split, naming the layers."""
    cuts = list(itertools.accumulate(counts))[:-1]
    total = sum(counts)
    for first, last in together:
        for k, cut in enumerate(cuts):
            if first < cut <= last:
                options = [
                    moved for moved in (_cut_at(cuts, k, first, total), _cut_at(cuts, k, last + 1, total)) if moved
                ]
                if options:
                    cuts = min(options, key=lambda moved: abs(moved[k] - cut))
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _cut_at(cuts: list[int], k: int, at: int, total: int) -> list[int] | None:
    """``cuts`` with cut ``k`` at block ``at``, the stages before (or after) it re-spread evenly if they are in the
    way; ``None`` if they hold too few blocks for a block each."""
    stages = len(cuts) + 1
    if not k + 1 <= at <= total - (stages - k - 1):
        return None
    moved = [*cuts[:k], at, *cuts[k + 1 :]]
    if k and moved[k - 1] >= at:
        moved[:k] = list(itertools.accumulate(balance_blocks(at, k + 1)))[:-1]
    if k + 1 < len(moved) and moved[k + 1] <= at:
        after = balance_blocks(total - at, stages - k - 1)
        moved[k + 1 :] = [at + c for c in itertools.accumulate(after)][:-1]
    return moved


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


def one_unit_counts(network: nn.Module, attribute: str, settings: PipelineSettings) -> list[int]:
    """Blocks per stage of a network that is one unit (:data:`~lightning_pipe.models.units.ONE_UNIT`): the first
    stage runs it, the others pass its output on (said once, on rank 0, naming the processes held for nothing).
    ``attribute``: the LightningModule's attribute holding the network, for messages."""
    num_stages = settings.num_stages
    name = f"`{attribute}`, a {type(network).__name__}" if attribute else type(network).__name__
    if settings.split_points is not None or not isinstance(settings.balance, str):
        given = (
            f"split_points={list(settings.split_points)!r}"
            if settings.split_points is not None
            else f"balance={list(settings.balance)!r}"
        )
        raise PipelineConfigError(
            f"`{given}`: the network ({name}) is one module with no submodules, a single unit, so there is nothing"
            " to place: the first stage runs it and every other stage passes its output on. Leave `split_points`"
            " and `balance` at their defaults, or better train it with `devices=1` (or data parallelism,"
            " `strategy='ddp'`)."
        )
    from lightning.fabric.utilities.rank_zero import rank_zero_warn

    idle = int(settings.pipeline_size) - 1
    rank_zero_warn(
        f"The network ({name}) is one unit (a module with no submodules) and the pipeline has {num_stages} stages:"
        f" stage 0 runs it and the other {num_stages - 1} stage(s) hold no unit, they only pass its output on, so"
        f" {idle} of the {idle + 1} pipeline processes are held for nothing (no speed-up, no memory saved). Train it"
        " with `devices=1`, or with data parallelism (`strategy='ddp'`).",
        category=UserWarning,
    )
    return [1] + [0] * (num_stages - 1)


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
