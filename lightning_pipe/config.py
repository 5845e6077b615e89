"""Resolution of the strategy's ``"auto"`` settings and validation of their combinations.

Pure functions over ints and names: the strategy calls them in ``setup_environment`` once the world size is known.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Union

# An int subclass whose restriction (> 0) LightningCLI/jsonargparse checks while parsing a config, so a bad value
# is reported as a parse error naming the key instead of failing later inside the strategy.
from jsonargparse.typing import NonNegativeInt as NonNegativeInt
from jsonargparse.typing import PositiveInt as PositiveInt

from lightning_pipe.errors import MicrobatchError, PipelineConfigError

ScheduleName = Literal[
    "auto", "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
]
#: Every schedule torch ships, by its canonical name.
SCHEDULES: tuple[str, ...] = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
#: Schedules that drive exactly one stage per rank.
SINGLE_STAGE: frozenset[str] = frozenset({"GPipe", "1F1B"})
#: Schedules that place two stages per rank in a V: stage s and stage 2*P-1-s share a rank, so the last stage is on
#: pipeline rank 0.
V_SHAPED: frozenset[str] = frozenset({"ZBVZeroBubble", "DualPipeV"})


def canonical_schedule(name: str) -> str:
    """Map a schedule name, in any letter case, to its canonical spelling (``"auto"`` stays ``"auto"``)."""
    lookup = {s.lower(): s for s in (*SCHEDULES, "auto")}
    try:
        return lookup[str(name).lower()]
    except KeyError:
        raise PipelineConfigError(
            f"Unknown `schedule={name!r}`. Choose one of {', '.join(SCHEDULES)} or 'auto'."
        ) from None


def resolve_schedule(schedule: str, stages_per_rank: Union[int, str]) -> tuple[str, int]:
    """Resolve ``schedule`` and ``stages_per_rank`` together.

    ``schedule="auto"`` is ``"1F1B"`` with one stage per rank and ``"Interleaved1F1B"`` with more.
    ``stages_per_rank="auto"`` is 1 for GPipe/1F1B and 2 for every multi-stage schedule.
    """
    name = canonical_schedule(schedule)
    if stages_per_rank != "auto" and (not isinstance(stages_per_rank, int) or stages_per_rank < 1):
        raise PipelineConfigError(f"`stages_per_rank` must be 'auto' or an int >= 1, got {stages_per_rank!r}.")
    if name == "auto":
        spr = 1 if stages_per_rank == "auto" else stages_per_rank
        return ("1F1B" if spr == 1 else "Interleaved1F1B"), spr
    if stages_per_rank == "auto":
        return name, 1 if name in SINGLE_STAGE else 2
    if name in SINGLE_STAGE and stages_per_rank != 1:
        raise PipelineConfigError(
            f"`schedule={name!r}` runs one stage per rank but `stages_per_rank={stages_per_rank}`. Use"
            " `stages_per_rank=1`, or a multi-stage schedule such as 'Interleaved1F1B'."
        )
    if name in V_SHAPED and stages_per_rank != 2:
        raise PipelineConfigError(
            f"`schedule={name!r}` places exactly two stages per rank (V shape) but `stages_per_rank={stages_per_rank}`."
            " Use `stages_per_rank=2` or 'auto'."
        )
    return name, stages_per_rank


def check_pipeline_size(pipeline_size: Union[int, str]) -> None:
    """Validate ``pipeline_size`` on its own (the world size is checked in :func:`resolve_pipeline_size`)."""
    if pipeline_size != "auto" and (not isinstance(pipeline_size, int) or pipeline_size < 1):
        raise PipelineConfigError(f"`pipeline_size` must be 'auto' or an int >= 1, got {pipeline_size!r}.")


def resolve_pipeline_size(pipeline_size: Union[int, str], world_size: int) -> tuple[int, int]:
    """Return ``(pipeline_size, data_parallel_size)``; ``"auto"`` makes every process one stage of one pipeline."""
    check_pipeline_size(pipeline_size)
    if pipeline_size == "auto":
        return world_size, 1
    if world_size % pipeline_size != 0:
        raise PipelineConfigError(
            f"The world size ({world_size} processes) is not divisible by `pipeline_size={pipeline_size}`: every"
            " data-parallel replica needs a whole pipeline. Set `pipeline_size` to a divisor of the world size, or"
            " change `devices`/`num_nodes`."
        )
    return pipeline_size, world_size // pipeline_size


def check_microbatch_settings(microbatches: Union[int, str], microbatch_size: Union[int, None]) -> None:
    """Validate the constructor's microbatch arguments before any batch is seen."""
    if microbatches != "auto" and (not isinstance(microbatches, int) or microbatches < 1):
        raise PipelineConfigError(f"`microbatches` must be 'auto' or an int >= 1, got {microbatches!r}.")
    if microbatch_size is not None:
        if not isinstance(microbatch_size, int) or microbatch_size < 1:
            raise PipelineConfigError(f"`microbatch_size` must be None or an int >= 1, got {microbatch_size!r}.")
        if microbatches != "auto":
            raise PipelineConfigError(
                f"Set either `microbatches` ({microbatches}) or `microbatch_size` ({microbatch_size}), not both."
            )


def resolve_microbatches(
    microbatches: Union[int, str], microbatch_size: Union[int, None], batch_size: int, num_stages: int, setting: str
) -> int:
    """The number of microbatches for one batch; ``"auto"`` is the number of stages (the fewest that fill the pipe).

    ``setting`` names the argument in error messages (``microbatches`` or ``eval_microbatches``).
    """
    if microbatch_size is not None:
        if batch_size % microbatch_size != 0:
            raise MicrobatchError(
                f"A batch of {batch_size} samples does not split into microbatches of `microbatch_size="
                f"{microbatch_size}`. Use a batch size that is a multiple of it (or `drop_last=True` in the"
                " DataLoader for a short last batch)."
            )
        return batch_size // microbatch_size
    n = num_stages if microbatches == "auto" else int(microbatches)
    if n > batch_size and microbatches == "auto":
        # A short final batch with "auto": as many single-sample microbatches as there are samples.
        n = batch_size
    if batch_size % n != 0:
        raise MicrobatchError(
            f"A batch of {batch_size} samples does not split into `{setting}={n}` equal microbatches"
            f"{' (auto: one per stage)' if microbatches == 'auto' else ''}. torch's pipeline needs equal microbatch"
            f" shapes. Use a batch size that is a multiple of {n}, set `{setting}` to a divisor of {batch_size},"
            " or pass `drop_last=True` to the DataLoader if only the last batch is short."
        )
    return n


BALANCE_MODES = ("auto", "params", "blocks")


def check_balance_setting(balance: Union[str, Sequence[int]]) -> None:
    """Validate ``balance`` on its own (its length and sum are checked against the model in the builder)."""
    if isinstance(balance, str):
        if balance not in BALANCE_MODES:
            raise PipelineConfigError(
                f"`balance={balance!r}` is not one of 'auto', 'params', 'blocks' or a list of blocks per stage."
            )
        return
    if not isinstance(balance, (list, tuple)) or not all(
        isinstance(n, int) and not isinstance(n, bool) for n in balance
    ):
        raise PipelineConfigError(
            f"`balance` must be 'auto', 'params', 'blocks' or a list of ints (blocks per stage), got {balance!r}."
        )
