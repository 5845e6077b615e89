"""The strategy's settings: one frozen object, validated once when it is made, with every ``"auto"`` resolved later.

:class:`PipelineSettings` holds every argument of ``PipelineParallelStrategy``. Its constructor checks each value and
each combination that needs no world size, so a bad configuration fails before any process starts, with an error that
names the argument, the value and the fix. :meth:`PipelineSettings.resolve` returns a copy in which the world-size
dependent ``"auto"`` values are decided; the layers below receive that copy instead of long parameter lists.

Pure: no process group, no step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args

import torch

# An int subclass whose restriction (> 0) LightningCLI/jsonargparse checks while parsing a config, so a bad value
# is reported as a parse error naming the key instead of failing later inside the strategy.
from jsonargparse.typing import NonNegativeInt as NonNegativeInt
from jsonargparse.typing import PositiveInt as PositiveInt

from lightning_pipe.compat import torch as torch_compat
from lightning_pipe.errors import PipelineConfigError, PipelineUsageError
from lightning_pipe.schedules.custom import CustomSchedule
from lightning_pipe.schedules.names import SCHEDULES as SCHEDULES
from lightning_pipe.schedules.names import SINGLE_STAGE as SINGLE_STAGE
from lightning_pipe.schedules.names import SPLIT_BACKWARD as SPLIT_BACKWARD
from lightning_pipe.schedules.names import V_SHAPED as V_SHAPED
from lightning_pipe.schedules.names import ScheduleName as ScheduleName
from lightning_pipe.schedules.names import canonical_schedule as canonical_schedule
from lightning_pipe.schedules.names import check_custom_counts, normal_schedule, splits_backward
from lightning_pipe.schedules.names import placement as schedule_placement
from lightning_pipe.schedules.names import resolve_schedule as resolve_schedule

#: Keyword arguments of ``torch.compile`` that ``compile={...}`` may set.
COMPILE_OPTIONS: tuple[str, ...] = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")
BalanceMode = Literal["auto", "params", "blocks"]
BALANCE_MODES: tuple[str, ...] = get_args(BalanceMode)
FrontendName = Literal["auto", "modules", "dataflow", "trace"]
FRONTENDS: tuple[str, ...] = get_args(FrontendName)
DataParallelMode = Literal["ddp", "fsdp"]
DATA_PARALLEL_MODES: tuple[str, ...] = get_args(DataParallelMode)
#: Where a network built in ``configure_model`` draws its initial values: one device's global stream, in one device's
#: order (each rank drawing and discarding the others' values), or each unit's own seed (no rank draws for another).
InitValues = Literal["one_device", "per_unit"]
INIT_VALUES: tuple[str, ...] = get_args(InitValues)
DP, PP, TP = "dp", "pp", "tp"
#: Which of the axes "dp" and "pp" holds consecutive ranks (ranks on one node when the launcher fills nodes in order);
#: "tp" is always innermost.
InnerAxis = Literal["dp", "pp"]

#: Default ``timeout`` of the strategy's process group: a third of torch's 30 minutes. A rank that raises or dies no
#: longer makes the others wait for it (the failure board and the watchdog end the run within seconds, on any
#: backend), so the timeout only bounds waits on a rank that hangs without failing: a deadlock, a lost node, an NCCL
#: hang. It must still exceed the longest legitimate one-sided wait, e.g. the other ranks waiting in a barrier while
#: one loads or writes a multi-GB checkpoint on slow storage, compiles its stages on the first step, or runs a
#: rank-0-only callback. 10 minutes is Megatron-LM's default (``--distributed-timeout-minutes``).
DEFAULT_TIMEOUT = timedelta(minutes=10)


# ---------------------------------------------------------------------------------------------------- checks
def _listed(names: Sequence[str]) -> str:
    """``'a', 'b', 'c'``: a list of allowed names for a message."""
    return ", ".join(repr(n) for n in names)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_count(name: str, value: object, meaning: str) -> None:
    """Refuse ``value`` of argument ``name`` unless it is an int >= 0 (``meaning``: what the number counts)."""
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise PipelineConfigError(f"`{name}={value!r}` must be an int >= 0: {meaning}")


def check_pipeline_size(pipeline_size: Union[int, str]) -> None:
    """Validate ``pipeline_size`` on its own (the world size is checked in :func:`resolve_pipeline_size`)."""
    if pipeline_size != "auto" and (not _is_int(pipeline_size) or pipeline_size < 1):  # type: ignore[operator]
        raise PipelineConfigError(f"`pipeline_size` must be 'auto' or an int >= 1, got {pipeline_size!r}.")


def resolve_pipeline_size(pipeline_size: Union[int, str], world_size: int, tensor_parallel: int = 1) -> tuple[int, int]:
    """Return ``(pipeline_size, data_parallel_size)`` for ``world_size`` processes of which each ``tensor_parallel``
    consecutive ones share every stage; ``"auto"`` makes the rest one pipeline, without data parallelism."""
    check_pipeline_size(pipeline_size)
    if world_size % tensor_parallel != 0:
        raise PipelineConfigError(
            f"The world size ({world_size} processes) is not divisible by `tensor_parallel={tensor_parallel}`: every"
            " stage is held by a whole group of tensor-parallel processes. Set `tensor_parallel` to a divisor of the"
            " world size, or change `devices`/`num_nodes`."
        )
    if pipeline_size == "auto":
        return world_size // tensor_parallel, 1
    size = int(pipeline_size)
    if world_size % (size * tensor_parallel) != 0:
        shared = f" x `tensor_parallel={tensor_parallel}`" if tensor_parallel > 1 else ""
        raise PipelineConfigError(
            f"The world size ({world_size} processes) is not divisible by `pipeline_size={size}`{shared}: every"
            " data-parallel replica needs a whole pipeline. Set `pipeline_size` to a divisor of the world size, or"
            " change `devices`/`num_nodes`."
        )
    if size > 1 and tensor_parallel > 1 and not torch_compat.stage_takes_mesh():
        raise PipelineConfigError(
            f"`tensor_parallel={tensor_parallel}` with `pipeline_size={size}` needs torch 2.13 or newer (this is"
            f" torch {torch.__version__}): its pipeline stages cannot receive the DTensor activations of"
            " tensor-parallel layers (`PipelineStage(get_mesh=...)` came with 2.13). Upgrade torch, or use"
            " `tensor_parallel=1` (data parallelism instead) with this torch."
        )
    return size, world_size // (size * tensor_parallel)


def check_tensor_parallel(tensor_parallel: Union[int, str], frontend: str) -> int:
    """Validate ``tensor_parallel`` (with the frontend it must work with); return its size (``"auto"`` is 1)."""
    if tensor_parallel != "auto" and (not _is_int(tensor_parallel) or tensor_parallel < 1):  # type: ignore[operator]
        raise PipelineConfigError(
            f"`tensor_parallel` must be 'auto' or an int >= 1 (processes sharing every stage), got {tensor_parallel!r}."
        )
    size = 1 if tensor_parallel == "auto" else int(tensor_parallel)
    if size > 1 and frontend == "trace":
        raise PipelineConfigError(
            f"`tensor_parallel={size}` needs `frontend='modules'`: torch's tracer (`frontend='trace'`) rejects the"
            " DTensor parameters and activations of tensor-parallel layers. Use `frontend='modules'` (or 'auto')."
        )
    if size > 1 and frontend == "dataflow":
        raise PipelineConfigError(
            f"`tensor_parallel={size}` is not supported with `frontend='dataflow'` (yet): its routes are planned on a"
            " copy of the network with fake parameters, which is not built for DTensor (tensor-parallel) layers."
            " Use `tensor_parallel=1` with `frontend='dataflow'`, or `frontend='modules'` for tensor parallelism."
        )
    return size


def check_microbatch_settings(microbatches: Union[int, str], microbatch_size: Union[int, None]) -> None:
    """Validate the constructor's microbatch arguments before any batch is seen."""
    if microbatches != "auto" and (not _is_int(microbatches) or microbatches < 1):  # type: ignore[operator]
        raise PipelineConfigError(f"`microbatches` must be 'auto' or an int >= 1, got {microbatches!r}.")
    if microbatch_size is not None:
        if not _is_int(microbatch_size) or microbatch_size < 1:
            raise PipelineConfigError(f"`microbatch_size` must be None or an int >= 1, got {microbatch_size!r}.")
        if microbatches != "auto":
            raise PipelineConfigError(
                f"Set either `microbatches` ({microbatches}) or `microbatch_size` ({microbatch_size}), not both."
            )


def check_eval_microbatches(value: object) -> None:
    """Validate ``eval_microbatches``."""
    if value != "auto" and (not _is_int(value) or value < 1):  # type: ignore[operator]
        raise PipelineConfigError(
            f"`eval_microbatches` must be 'auto' or an int >= 1, got {value!r}. 'auto' uses one microbatch per"
            " process of the pipeline."
        )


def check_balance_setting(balance: Union[str, Sequence[int]]) -> None:
    """Validate ``balance`` on its own (its length and sum are checked against the model in the builder)."""
    if isinstance(balance, str):
        if balance not in BALANCE_MODES:
            raise PipelineConfigError(
                f"`balance={balance!r}` is not one of {_listed(BALANCE_MODES)} or a list of blocks per stage."
            )
        return
    if not isinstance(balance, (list, tuple)) or not all(_is_int(n) for n in balance):
        raise PipelineConfigError(
            f"`balance` must be {_listed(BALANCE_MODES)} or a list of ints (blocks per stage), got {balance!r}."
        )


#: A pipeline plan, as transformers' ``base_model_pp_plan``: ``{module name: (input names, output names)}``.
ModelPlan = dict[str, tuple[list[str], list[str]]]


def check_model_plan(plan: Any) -> Optional[ModelPlan]:
    """Validate ``model_plan`` (``None``, or a plan shaped as transformers' ``base_model_pp_plan``); returns it with
    lists for the inputs and outputs."""
    if plan is None:
        return None
    example = "e.g. {'model.embed_tokens': (['input_ids'], ['inputs_embeds']), 'model.layers': (['hidden_states'],"
    example += " ['hidden_states']), 'model.norm': (['hidden_states'], ['hidden_states'])}"
    if not isinstance(plan, dict) or not plan:
        raise PipelineConfigError(
            f"`model_plan` must be a non-empty dict of module names to (input names, output names), {example};"
            f" got {plan!r}."
        )
    checked: ModelPlan = {}
    for key, value in plan.items():
        if not isinstance(key, str) or not key or any(not part.isidentifier() for part in key.split(".")):
            raise PipelineConfigError(
                f"`model_plan` key {key!r} is not a module name; name each module as `named_modules()` gives it"
                f" (`model.layers`), {example}."
            )
        pair = list(value) if isinstance(value, (list, tuple)) else None
        if (
            pair is None
            or len(pair) != 2
            or not all(
                isinstance(names, (list, tuple)) and all(isinstance(n, str) and n for n in names) for names in pair
            )
        ):
            raise PipelineConfigError(
                f"`model_plan[{key!r}]` is {value!r}; it must be (input names, output names), two lists of"
                f" argument names as in transformers' `base_model_pp_plan`, {example}."
            )
        checked[key] = (list(pair[0]), list(pair[1]))
    return checked


def check_blocks(blocks: Union[str, Sequence[str]], frontend: str) -> None:
    """Validate ``blocks``: a container name, ``"auto"``, or (``frontend="dataflow"`` only) a list of them."""
    if isinstance(blocks, str):
        return
    if not isinstance(blocks, (list, tuple)) or not blocks or not all(isinstance(b, str) for b in blocks):
        raise PipelineConfigError(
            f"`blocks` must be 'auto', the name of a container of blocks, or a list of such names, got {blocks!r}."
        )
    if frontend not in ("dataflow", "auto"):
        raise PipelineConfigError(
            f"`blocks={list(blocks)}` names several block stacks, which only `frontend='dataflow'` pipelines (the"
            f" {frontend} frontend passes one activation through one stack)."
            " Pass `frontend='dataflow'`, or name one container."
        )


def check_data_parallel(data_parallel: str) -> None:
    if data_parallel not in DATA_PARALLEL_MODES:
        raise PipelineConfigError(
            f"`data_parallel={data_parallel!r}` is not one of {_listed(DATA_PARALLEL_MODES)}. Use 'ddp' to replicate"
            " each stage on every data-parallel rank, or 'fsdp' to shard its parameters, gradients and optimizer state."
        )


def check_init_values(init_values: str) -> None:
    if init_values not in INIT_VALUES:
        raise PipelineConfigError(
            f"`init_values={init_values!r}` is not one of {_listed(INIT_VALUES)}. Use 'one_device' for the values a"
            " single device draws with the same seed, or 'per_unit' for draws under each unit's own seed (no rank"
            " draws for another's units)."
        )


def check_inner_axis(inner_axis: str) -> None:
    if inner_axis not in (PP, DP):
        raise PipelineConfigError(
            f"`inner_axis={inner_axis!r}` is not one of 'dp', 'pp'. Use 'dp' to keep each stage's data-parallel"
            " replicas on consecutive ranks (one node), or 'pp' to keep each pipeline's stages there."
        )


def resolve_every(activation_checkpointing: Union[bool, int]) -> int:
    """Which blocks are checkpointed: every ``k``-th; ``True`` is 1 (every block), ``False`` is 0 (none)."""
    if isinstance(activation_checkpointing, bool):
        return int(activation_checkpointing)
    if not _is_int(activation_checkpointing) or activation_checkpointing < 0:
        raise PipelineConfigError(
            f"`activation_checkpointing={activation_checkpointing!r}` must be a bool or an int >= 0 (k checkpoints"
            " every k-th block). Use True for every block, False or 0 for none, or a positive int."
        )
    return activation_checkpointing


def resolve_compile(compile: Union[bool, dict[str, Any], None]) -> Optional[dict[str, Any]]:
    """``torch.compile`` keyword arguments for ``compile``: ``None`` (off) for ``False``, ``{}`` for ``True``."""
    if compile is None:
        return None
    if isinstance(compile, bool):
        return {} if compile else None
    if not isinstance(compile, dict) or not all(isinstance(k, str) for k in compile):
        raise PipelineConfigError(
            f"`compile={compile!r}` must be True, False or a dict of torch.compile options (e.g."
            " {'mode': 'max-autotune'})."
        )
    unknown = sorted(set(compile) - set(COMPILE_OPTIONS))
    if unknown:
        raise PipelineConfigError(
            f"`compile` has options torch.compile does not take per block: {unknown}. Use only"
            f" {', '.join(COMPILE_OPTIONS)}."
        )
    return dict(compile)


def check_compile_schedule(compile: Optional[dict[str, Any]], schedule: Union[str, CustomSchedule]) -> None:
    """Refuse compiled blocks under the schedules that split the backward (:data:`SPLIT_BACKWARD`, or I and W
    actions in a schedule of one's own)."""
    if compile is not None and splits_backward(schedule):
        raise PipelineConfigError(
            f"`compile` cannot be used with `schedule={str(schedule)!r}`: {', '.join(sorted(SPLIT_BACKWARD))} (and"
            " schedules of one's own with I and W actions) split each backward into an input-gradient and a"
            " weight-gradient pass over the same autograd graph, and a compiled block's backward is a single node"
            " that computes both at once (torch 2.13 refuses compiled stages under these schedules). Use"
            " `schedule` 'GPipe', '1F1B', 'Interleaved1F1B' or 'LoopedBFS' with `compile`, or turn `compile` off."
        )


def check_max_restarts(max_restarts: object) -> None:
    _check_count(
        "max_restarts",
        max_restarts,
        "how many times Lightning's launcher starts every rank again after a failure (0: never). Under torchrun, pass"
        " `--max-restarts` to torchrun instead.",
    )


#: What ``snapshot_every="auto"`` takes where recovery in place applies: an interval at which the snapshots cost the
#: GPT example under 5% of its step with a margin for the measurement's noise (docs/benchmarks.md#recovery-in-place).
AUTO_SNAPSHOT_EVERY = 20


def check_snapshot_every(
    snapshot_every: object, max_restarts: object, data_parallel: object, tensor_parallel: object
) -> None:
    if snapshot_every == "auto":
        return
    _check_count(
        "snapshot_every",
        snapshot_every,
        "every how many training steps each rank keeps a copy of its state in its own and a buddy rank's memory"
        f" (0: never; 'auto': every {AUTO_SNAPSHOT_EVERY} steps where a lost rank can be recovered in place).",
    )
    if snapshot_every and not max_restarts:
        raise PipelineConfigError(
            f"`snapshot_every={snapshot_every}` recovers a lost rank in place, which the supervisor of `max_restarts`"
            " does, but `max_restarts=0`. Set `max_restarts` (e.g. 3), or leave `snapshot_every` at 0."
        )
    if snapshot_every and (data_parallel == "fsdp" or tensor_parallel not in ("auto", 1)):
        raise PipelineConfigError(
            f"`snapshot_every={snapshot_every}` snapshots whole stages, but `data_parallel={data_parallel!r}`,"
            f" `tensor_parallel={tensor_parallel!r}` shard them (sharded snapshots are not supported yet). Use"
            " `data_parallel='ddp'` and `tensor_parallel=1`, or leave `snapshot_every` at 0 (restarts then resume"
            " from disk)."
        )


def resolve_snapshot_every(
    snapshot_every: Union[str, int], max_restarts: int, data_parallel: str, tensor_parallel: Union[str, int]
) -> int:
    """The snapshot interval (0: none). ``"auto"`` is :data:`AUTO_SNAPSHOT_EVERY` where recovery in place can apply
    (``max_restarts`` and whole stages; the strategy also skips it where no supervisor recovers in place), else 0."""
    if snapshot_every != "auto":
        return int(snapshot_every)
    whole = data_parallel != "fsdp" and tensor_parallel in ("auto", 1)
    return AUTO_SNAPSHOT_EVERY if max_restarts and whole else 0


def check_spares(spares: object, snapshot_every: object, interval: int) -> None:
    _check_count(
        "spares",
        spares,
        "how many processes the supervisor of `max_restarts` starts with the run to take a lost rank's place (0: a"
        " new process is started then).",
    )
    if spares and not interval:
        raise PipelineConfigError(
            f"`spares={spares}` takes a lost rank's place in a recovery in place, which needs snapshots, but"
            f" `snapshot_every={snapshot_every!r}` takes none. Set `max_restarts` (and leave `snapshot_every` at"
            " 'auto', or set it), or leave `spares` at 0."
        )


def check_async_checkpoint(async_checkpoint: object) -> None:
    if not isinstance(async_checkpoint, bool):
        raise PipelineConfigError(
            f"`async_checkpoint={async_checkpoint!r}` must be True (a save blocks the step only while the state is"
            " copied to host memory; a thread writes it) or False (a save returns once written)."
        )


# ---------------------------------------------------------------------------------------------------- the settings
#: Fields of :class:`PipelineSettings` that no constructor takes: decided when the processes start.
RESOLVED_ONLY = ("world_size",)


def argument_names() -> tuple[str, ...]:
    """The strategies' arguments, in their constructors' order: the fields of :class:`PipelineSettings` but
    :data:`RESOLVED_ONLY`."""
    return tuple(f.name for f in dataclasses.fields(PipelineSettings) if f.name not in RESOLVED_ONLY)


@dataclass(frozen=True)
class PipelineSettings:
    """Every argument of both strategies, validated once, when it is made: the fields but ``world_size``
    (:func:`argument_names`) are the constructor's arguments (``lightning_pipe.session.PipelineArguments``, which
    documents them), in its order, with its annotations and defaults (a test ties them together).

    Values are normalised: ``schedule`` to its canonical spelling, lists to tuples, ``activation_checkpointing`` to
    the block interval (``frontend="auto"`` is resolved per network at the cut). ``world_size`` is ``None`` until
    :meth:`resolve` decides the ``"auto"`` values that depend on it.
    """

    pipeline_size: Union[Literal["auto"], PositiveInt] = "auto"
    #: a name, a CSV path or lists of per-rank actions (normalised to the canonical name or a ``CustomSchedule``)
    schedule: Union[ScheduleName, str, list[list[str]]] = "auto"
    microbatches: Union[Literal["auto"], PositiveInt] = "auto"
    microbatch_size: Optional[PositiveInt] = None
    stages_per_rank: Union[Literal["auto"], PositiveInt] = "auto"
    module: str = "auto"
    frontend: FrontendName = "auto"
    #: a container name, or several (normalised to a tuple)
    blocks: Union[str, list[str]] = "auto"
    #: normalised to a tuple
    split_points: Optional[list[str]] = None
    #: a mode, or blocks per stage (normalised to a tuple)
    balance: Union[BalanceMode, list[PositiveInt]] = "auto"
    process_group_backend: Optional[str] = None
    timeout: Optional[timedelta] = DEFAULT_TIMEOUT
    #: normalised to a ``Path``
    init_weights: Optional[Union[str, Path]] = None
    #: a PEFT adapter directory to start the adapters from (after ``init_weights``; normalised to a ``Path``)
    init_adapter: Optional[Union[str, Path]] = None
    #: the initial values of a network built in ``configure_model``: one device's, or per-unit seeds
    init_values: InitValues = "one_device"
    eval_microbatches: Union[Literal["auto"], PositiveInt] = "auto"
    data_parallel: DataParallelMode = "ddp"
    inner_axis: InnerAxis = "dp"
    #: normalised to the interval k: checkpoint every k-th block of the block stack (0: none)
    activation_checkpointing: Union[bool, NonNegativeInt] = False
    tensor_parallel: Union[Literal["auto"], PositiveInt] = "auto"
    loss_parallel: bool = False
    #: normalised to ``torch.compile``'s options of every block (``None``: not compiled)
    compile: Union[bool, dict[str, Any]] = False
    #: times Lightning's launcher starts every rank again after a failure (torchrun: its own ``--max-restarts``)
    max_restarts: NonNegativeInt = 0
    #: training steps between in-memory snapshots for recovery in place (0: none; ``"auto"``:
    #: :data:`AUTO_SNAPSHOT_EVERY` with ``max_restarts`` and whole stages, else none; :attr:`snapshot_interval`)
    snapshot_every: Union[Literal["auto"], NonNegativeInt] = "auto"
    #: processes started with the run that wait to replace a lost rank (recovery in place)
    spares: NonNegativeInt = 0
    #: checkpoints written by a thread after a copy to host memory
    async_checkpoint: bool = False
    #: the pipeline plan of a transformers model whose family has none (names relative to the model)
    model_plan: Optional[ModelPlan] = None
    #: the processes of the run; ``None`` until :meth:`resolve`
    world_size: Optional[int] = None

    def __post_init__(self) -> None:
        check_pipeline_size(self.pipeline_size)
        schedule = normal_schedule(self.schedule)
        resolve_schedule(schedule, self.stages_per_rank)
        check_microbatch_settings(self.microbatches, self.microbatch_size)
        check_eval_microbatches(self.eval_microbatches)
        check_balance_setting(self.balance)
        if self.split_points is not None and not isinstance(self.balance, str):
            raise PipelineConfigError("Set either `split_points` or `balance`, not both.")
        if self.frontend not in FRONTENDS:
            raise PipelineConfigError(f"`frontend={self.frontend!r}` is not one of {_listed(FRONTENDS)}.")
        check_blocks(self.blocks, self.frontend)
        check_data_parallel(self.data_parallel)
        check_inner_axis(self.inner_axis)
        check_init_values(self.init_values)
        check_tensor_parallel(self.tensor_parallel, self.frontend)
        if not isinstance(self.loss_parallel, bool):
            raise PipelineConfigError(f"`loss_parallel` must be True or False, got {self.loss_parallel!r}.")
        compile_options = resolve_compile(self.compile)
        check_compile_schedule(compile_options, schedule)
        check_max_restarts(self.max_restarts)
        check_snapshot_every(self.snapshot_every, self.max_restarts, self.data_parallel, self.tensor_parallel)
        check_spares(self.spares, self.snapshot_every, self.snapshot_interval)
        check_async_checkpoint(self.async_checkpoint)
        normal = {
            "schedule": schedule,
            "frontend": self.frontend,
            "split_points": None if self.split_points is None else tuple(self.split_points),
            "blocks": self.blocks if isinstance(self.blocks, str) else tuple(self.blocks),
            "balance": self.balance if isinstance(self.balance, str) else tuple(self.balance),
            "activation_checkpointing": resolve_every(self.activation_checkpointing),
            "init_weights": None if self.init_weights is None else Path(self.init_weights),
            "init_adapter": None if self.init_adapter is None else Path(self.init_adapter),
            "compile": compile_options,
            "model_plan": check_model_plan(self.model_plan),
        }
        if isinstance(schedule, CustomSchedule):
            # the schedule decides the pipeline size and the microbatch count (given ones must agree)
            check_custom_counts(schedule, self.pipeline_size, self.microbatches, self.microbatch_size)
            normal.update(pipeline_size=schedule.pipeline_size, microbatches=schedule.microbatches)
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    def tuned(self, **changes: Any) -> PipelineSettings:
        """A copy with ``changes`` (what the tuner chose), validated; only before the processes start."""
        if self.resolved:
            raise PipelineUsageError(
                "The strategy's settings are fixed once its Trainer has started; tune before `trainer.fit`."
            )
        return dataclasses.replace(self, **changes)

    def with_frontend(self, frontend: str) -> PipelineSettings:
        """A copy with ``frontend`` (``"auto"`` resolved for the network at the cut)."""
        return dataclasses.replace(self, frontend=frontend)

    def resolve(self, world_size: int) -> PipelineSettings:
        """A copy with ``pipeline_size``, ``schedule``, ``stages_per_rank`` and ``tensor_parallel`` decided for
        ``world_size`` processes."""
        tensor_parallel = check_tensor_parallel(self.tensor_parallel, self.frontend)
        pipeline_size, _ = resolve_pipeline_size(self.pipeline_size, world_size, tensor_parallel)
        schedule, stages_per_rank = resolve_schedule(self.schedule, self.stages_per_rank)
        return dataclasses.replace(
            self,
            tensor_parallel=tensor_parallel,
            pipeline_size=pipeline_size,
            schedule=schedule,
            stages_per_rank=stages_per_rank,
            world_size=world_size,
        )

    # ------------------------------------------------------------------------------------------ resolved values
    @property
    def resolved(self) -> bool:
        return self.world_size is not None

    def _require(self, what: str) -> None:
        if not self.resolved:
            raise PipelineUsageError(f"`{what}` is resolved when the processes start (setup_environment).")

    @property
    def data_parallel_size(self) -> int:
        """Pipelines (data-parallel replicas): ``world_size / (pipeline_size * tensor_parallel)``."""
        self._require("data_parallel_size")
        return int(self.world_size) // (int(self.pipeline_size) * self.tensor_parallel_size)  # type: ignore[arg-type]

    @property
    def tensor_parallel_size(self) -> int:
        """Processes sharing every stage (``"auto"``: 1); known before :meth:`resolve`."""
        return 1 if self.tensor_parallel == "auto" else int(self.tensor_parallel)

    @property
    def snapshot_interval(self) -> int:
        """Training steps between snapshots (0: none): ``snapshot_every`` with ``"auto"`` decided; known before
        :meth:`resolve`."""
        return resolve_snapshot_every(self.snapshot_every, self.max_restarts, self.data_parallel, self.tensor_parallel)

    @property
    def num_stages(self) -> int:
        self._require("pipeline_size")
        return int(self.pipeline_size) * int(self.stages_per_rank)

    @property
    def placement(self) -> str:
        """How stages sit on the ranks of a pipeline: ``"v"`` (there and back) for V schedules, else ``"loop"``; a
        schedule of one's own places them as its rows name them (one of the two, checked when it is read)."""
        self._require("schedule")
        return schedule_placement(self.schedule)

    @property
    def sharded(self) -> bool:
        """Whether stages are sharded over data-parallel replicas (``"fsdp"`` with more than one replica)."""
        return self.data_parallel == "fsdp" and self.data_parallel_size > 1

    def split_key(self) -> tuple:
        """The settings that decide which units each stage holds and where it lives: two Trainers whose keys are
        equal can share one split (another schedule of the same placement and stages per rank, other activation
        checkpointing, other data parallelism)."""
        return (
            self.module,
            self.frontend,
            self.blocks,
            self.split_points,
            self.balance,
            self.pipeline_size,
            self.stages_per_rank,
            self.placement,
            self.model_plan,
        )

    def describe_split(self) -> str:
        """The split key's settings by name, for messages."""
        names = ("module", "frontend", "blocks", "split_points", "balance", "pipeline_size", "stages_per_rank")
        parts = [f"{n}={v!r}" for n, v in zip(names, self.split_key())]
        if self.model_plan is not None:
            parts.append(f"model_plan={self.model_plan!r}")
        return ", ".join([*parts, f"placement={self.placement!r} (schedule {self.schedule})"])
