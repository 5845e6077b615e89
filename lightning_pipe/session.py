"""One pipeline per process, under either front end: what the Trainer's and Fabric's strategies both need.

:class:`PipelineSession` is a plain object built from :class:`~lightning_pipe.settings.PipelineSettings`. It owns the
mesh, the split, the step engine, the stage wrappers, ties and gradients, the random streams' agreement, the
checkpoint topology, the initial weights (one path, one set of rules, its peak memory measured) and the ``ExitStack``
that undoes what a run installed on the user's objects. :class:`PipelineArguments` is the constructor both strategies
share: one typed argument list, the settings built field by field. ``strategy.py`` and ``fabric.py`` only adapt their
front end's hooks to these two (as Lightning's Trainer strategies reuse Fabric's helpers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from contextlib import ExitStack, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from torch import nn

from lightning_pipe.checkpoint import adapters as ckpt_adapters
from lightning_pipe.checkpoint import io as ckpt_io
from lightning_pipe.checkpoint.whole_state import keep_own_entries
from lightning_pipe.comm import collectives
from lightning_pipe.comm.mesh import MeshAxes, MeshCache
from lightning_pipe.compat import lightning as pl_compat
from lightning_pipe.compat import transformers as hf_compat
from lightning_pipe.errors import PipelineUsageError
from lightning_pipe.measure.memory import PeakMemory
from lightning_pipe.parallel.grads import GradientSync, StageGradients, TieGroups, stage_gradients
from lightning_pipe.parallel.tensor_parallel import TensorParallel
from lightning_pipe.parallel.wrappers import Wrapped, unwrap_stages, wrap_stages
from lightning_pipe.reliability import failures
from lightning_pipe.settings import (
    DEFAULT_TIMEOUT,
    DP,
    BalanceMode,
    DataParallelMode,
    FrontendName,
    InitValues,
    InnerAxis,
    ModelPlan,
    NonNegativeInt,
    PipelineSettings,
    PositiveInt,
    ScheduleName,
)
from lightning_pipe.split import tied
from lightning_pipe.split.builder import Split, existing_split, split_module
from lightning_pipe.split.deferred_init import InitRecording, record_init
from lightning_pipe.step.engine import StepEngine
from lightning_pipe.step.rng import RngStreams
from lightning_pipe.step.runtime import PipelineRuntime

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class PipelineSession(MeshAxes):
    """This process's pipeline: its place on the mesh, its stages and everything built around them."""

    def __init__(self, settings: PipelineSettings) -> None:
        self._settings = settings
        self._mesh: Optional[DeviceMesh] = None
        self.meshes = MeshCache()
        self.split: Optional[Split] = None
        self._engine: Optional[StepEngine] = None
        self.gradients: Optional[StageGradients] = None
        self.wrapped = Wrapped()
        self.ties = TieGroups()
        self.rng = RngStreams()
        self.recording: Optional[InitRecording] = None
        #: the peak memory of loading ``init_weights`` / ``init_adapter`` (loaded once, at the first setup)
        self.load_peak: Optional[PeakMemory] = None
        #: what this run (a Trainer entry, a Fabric setup) installed on the user's objects, undone by :meth:`close`
        self.run = ExitStack()
        self.global_rank, self.world_size = 0, 1

    def release_groups(self) -> None:
        """A peer was lost (recovery in place): forget every process group of the broken run (the mesh, the
        pipeline's, the gradients', the ties'). gloo closes a group's connections only when its last reference goes,
        and a survivor still holding them would leave a peer blocked in a collective with it (another replica's
        gradient all-reduce, a stage's transfer) until the timeout instead of failing at once. The next setup builds
        them again on the new process group."""
        self._mesh, self.meshes, self._engine, self.gradients, self.ties = None, MeshCache(), None, None, TieGroups()

    # ------------------------------------------------------------------ settings and topology
    @property
    def settings(self) -> PipelineSettings:
        return self._settings

    def tune(self, **changes: Any) -> None:
        """Replace settings before the processes start (what :func:`lightning_pipe.tune.tune` chose)."""
        self._settings = self._settings.tuned(**changes)

    def start(self, backend: str, global_rank: int, world_size: int, device_type: str) -> DeviceMesh:
        """Resolve the ``"auto"`` settings for ``world_size`` processes and build the mesh (collective), once the
        process group exists."""
        self.global_rank, self.world_size = global_rank, world_size
        self._settings = dataclasses.replace(self._settings, process_group_backend=backend).resolve(world_size)
        self._mesh = self.meshes.build(self._settings, device_type)
        return self._mesh

    @property
    def mesh_or_none(self) -> Optional[DeviceMesh]:
        return self._mesh

    @property
    def data_parallel_size(self) -> int:
        return self._settings.data_parallel_size if self._settings.resolved else 1

    @property
    def engine(self) -> Optional[StepEngine]:
        """The step engine (``None`` until the model is set up)."""
        return self._engine

    @property
    def runtime(self) -> PipelineRuntime:
        assert self._engine is not None, "the model is set up"
        return self._engine.runtime

    def topology(self) -> ckpt_io.Topology:
        """Where this process sits, as the checkpoint code needs it. Every tied parameter is kept once, under its first
        name, whether its names are on one stage or several: the checkpoint is then the same for every layout."""
        split, settings = self.split, self._settings
        return ckpt_io.Topology(
            global_rank=self.global_rank,
            world_size=self.world_size,
            pipeline_rank=self.pipeline_rank,
            pipeline_size=int(settings.pipeline_size),
            data_parallel_rank=self.data_parallel_rank,
            data_parallel_size=self.data_parallel_size,
            stages_per_rank=int(settings.stages_per_rank),
            schedule=str(settings.schedule),
            pipeline_group=self.pipeline_group,
            aliases=tied.aliases(split.shared, split.prefix) if split is not None else {},
            sharded=self.wrapped.sharded,
            tensor_parallel_rank=self.tensor_parallel_rank,
            tensor_parallel_size=self.tensor_parallel_size,
            replica_group=self.meshes.replica_group,
            network_prefix=split.prefix if split is not None else "",
        )

    # ------------------------------------------------------------------ the model
    @contextmanager
    def meta_init(self, device: torch.device) -> Generator[None, None, None]:
        """Modules created inside go on the meta device, and what is done to their tensors is recorded, with the random
        streams (CPU and ``device``'s) as they were: :meth:`cut` allocates only this rank's stages and replays the
        record on them."""
        # transformers 5 skips a model's init on the meta device; one device's values need it recorded
        complete = hf_compat.init_on_meta() if self._settings.init_values == "one_device" else nullcontext()
        with torch.device("meta"), complete, record_init(device) as recording:
            yield
        self.recording = recording

    def finish_recording(self, module: nn.Module) -> None:
        """Name the recorded tensors after ``module``'s (the module the model was built in)."""
        if self.recording is not None:
            self.recording = self.recording.finish(module)

    def cut(
        self, module: nn.Module, device: torch.device, announce: Callable[[str], None], rejoin: bool = False
    ) -> Split:
        """This rank's stages of ``module``'s network: cut now (in place, replaying the recorded initialisation, which
        :meth:`finish_recording` named) or found from an earlier cut. ``rejoin`` (a recovery in place, collective):
        a replacement rank cuts with the blocks per stage of the ranks that kept their cut."""
        recording, self.recording = self.recording, None  # replayed: its meta tensors can go
        world = collectives.world_group()
        kept: Optional[list[int]] = None
        if rejoin:
            existing = existing_split(module)
            gathered = collectives.all_gather_object(existing.counts if existing else None, world, device=device)
            kept = list(next(c for c in gathered if c))

        def agree(value: Any) -> Any:
            return kept if kept is not None else collectives.broadcast_object(value, 0, world, device=device)

        return split_module(
            module,
            self._settings,
            pipeline_rank=self.pipeline_rank,
            device=device,
            agree=agree,
            announce=announce,
            recording=recording,
        )

    def build(
        self,
        module: nn.Module,
        split: Split,
        *,
        device: torch.device,
        place: Callable[[], None],
        precision: Optional[str],
        strict: bool,
        outside: Optional[str] = None,
    ) -> None:
        """Build the pipeline of ``split`` in ``module``, in this order: the step engine; ``place()`` (the front end
        moves the model to ``device``); the initial weights (once); the stage wrappers; the tied copies and the
        gradients; ``load_state_dict`` of a whole state dict. ``outside``: the message for a call of the network
        outside a step. The front end agrees the random streams (:meth:`agree_random_streams`) where its own order
        puts it."""
        self.split = split
        self._engine = StepEngine(
            module, split, self._settings, self.pipeline_group, device, self.rng, self.device_mesh, outside
        )
        self.run.callback(self._close_engine)
        failures.describe(self.global_rank, list(self.runtime.stages))
        place()
        self.load_initial_weights(module, device=device, precision=precision, strict=strict)
        self._wrap(split)
        # After wrapping (FSDP replaces parameters): this rank's copies of parameters shared across stages.
        ties = self.ties.copies(self._mesh, self.meshes.layout, split, module)
        self.gradients = stage_gradients(module, ties, self.device_mesh, self.wrapped)
        # `load_state_dict` of the whole model (litgpt's `load_checkpoint`, `fabric.load_raw`): this rank's entries.
        self.run.callback(keep_own_entries(split.network, split.state_shapes, split.ties).remove)

    def load_initial_weights(
        self, model: nn.Module, *, device: torch.device, precision: Optional[str], strict: bool
    ) -> None:
        """``init_weights`` into this rank's stages (each rank reads only its own tensors, in the precision's dtype),
        then the PEFT adapters of ``init_adapter``; the load's peak memory in :attr:`load_peak`. Once: a ``validate``
        after ``fit`` uses the trained weights, not the start weights again."""
        weights, adapter = self._settings.init_weights, self._settings.init_adapter
        if (weights, adapter) == (None, None) or self.load_peak is not None:
            return
        assert self.split is not None
        topology, prefix = self.topology(), self.split.prefix
        with PeakMemory(device) as peak:
            if weights is not None:
                path = Path(weights)
                ckpt_io.load_weights(path, topology, model, network_prefix=prefix, strict=strict, precision=precision)
            if adapter is not None:
                ckpt_adapters.load_adapters(Path(adapter), topology, model, network_prefix=prefix)
        self.load_peak = peak

    def _wrap(self, split: Split) -> None:
        """Tensor parallelism, activation checkpointing and FSDP on this rank's stages (:func:`wrap_stages`), before
        the optimizers are created: they must hold the sharded parameters."""
        stages = self.runtime.stages
        self.wrapped = wrap_stages(
            stages,
            split.block_names,
            checkpoint_every=self._settings.activation_checkpointing,
            compile_options=self._settings.compile,
            dp_mesh=self.device_mesh[DP] if self._settings.sharded else None,
            sharded_over=split.sharded_over,
            tensor_parallel=TensorParallel(split, self.device_mesh) if self.tensor_parallel_size > 1 else None,
        )
        split.sharded_over, split.tensor_parallel = self.wrapped.sharded_over, self.wrapped.tensor_parallel
        self.run.callback(unwrap_stages, stages)

    def agree_random_streams(self) -> None:
        """Every stage draws the same shuffling order, the processes sharing a stage the same dropout: their first
        rank decides."""
        self.rng.agree(self.tensor_parallel_group, collectives.group_ranks(self.tensor_parallel_group)[0])
        self.rng.agree(self.pipeline_group, self.runtime.group_ranks[0])

    # ------------------------------------------------------------------ end
    def _close_engine(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self._engine = None

    def close(self) -> None:
        """Undo what this run installed on the user's objects (wrappers, interceptors, patched methods)."""
        self.run.close()
        self.run = ExitStack()


class PipelineArguments(MeshAxes):
    """The constructor and the session's view that both strategies share (a mixin: the strategy provides
    :meth:`init_front_end`, its Lightning base's own initialisation)."""

    _session: PipelineSession
    #: the message for a use of the pipeline before the front end built it
    not_built = "The pipeline is built when the model is set up; it does not exist yet."

    def __init__(
        self,
        pipeline_size: Union[Literal["auto"], PositiveInt] = "auto",
        schedule: Union[ScheduleName, str, list[list[str]]] = "auto",
        microbatches: Union[Literal["auto"], PositiveInt] = "auto",
        microbatch_size: Optional[PositiveInt] = None,
        stages_per_rank: Union[Literal["auto"], PositiveInt] = "auto",
        module: str = "auto",
        frontend: FrontendName = "auto",
        blocks: Union[str, list[str]] = "auto",
        split_points: Optional[list[str]] = None,
        balance: Union[BalanceMode, list[PositiveInt]] = "auto",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = DEFAULT_TIMEOUT,
        init_weights: Optional[Union[str, Path]] = None,
        init_adapter: Optional[Union[str, Path]] = None,
        init_values: InitValues = "one_device",
        eval_microbatches: Union[Literal["auto"], PositiveInt] = "auto",
        data_parallel: DataParallelMode = "ddp",
        inner_axis: InnerAxis = "dp",
        activation_checkpointing: Union[bool, NonNegativeInt] = False,
        tensor_parallel: Union[Literal["auto"], PositiveInt] = "auto",
        loss_parallel: bool = False,
        compile: Union[bool, dict[str, Any]] = False,
        max_restarts: NonNegativeInt = 0,
        snapshot_every: Union[Literal["auto"], NonNegativeInt] = "auto",
        spares: NonNegativeInt = 0,
        async_checkpoint: bool = False,
        model_plan: Optional[ModelPlan] = None,
    ) -> None:
        """Every argument is described in docs/strategy.md; each is validated now, so a bad configuration fails before
        processes start, and ``"auto"`` values are resolved when they do.

        Arguments:
            pipeline_size: Processes per pipeline. A divisor of the world size; the quotient is the data-parallel
                size. ``"auto"``: all processes.
            schedule: A torch schedule by name, any letter case (``GPipe``, ``1F1B``, ``Interleaved1F1B``,
                ``LoopedBFS``, ``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``). ``"auto"``: ``1F1B``
                with one stage per rank, ``Interleaved1F1B`` with more. Or a schedule of one's own: the path to a
                CSV file of per-rank actions in torch's format, or (in Python) a list of action strings per rank;
                it decides the pipeline size, the stages per rank and the microbatches (docs/custom-schedules.md).
            microbatches: Microbatches per training batch. A divisor of the batch size. ``"auto"``: the number of
                stages.
            microbatch_size: Samples per microbatch instead of a count. Default ``None``: use ``microbatches``.
            stages_per_rank: Stages each process holds. ``"auto"``: 1 for ``GPipe``/``1F1B``, 2 for the others
                (round robin, or a V for ``ZBVZeroBubble``/``DualPipeV``).
            module: Attribute holding the network. ``"auto"``: the only child with parameters, else the module.
            frontend: ``"modules"`` (the forward skips units set to ``None``), ``"dataflow"`` (an unmodified forward
                on every stage, values routed to the stages that read them) or ``"trace"``. ``"auto"``, per network:
                ``"modules"`` for an ``nn.Sequential``, a transformers model or a forward that tests its units
                against ``None``; ``"dataflow"`` otherwise (and for several block stacks); said once on rank 0.
            blocks: The container(s) of repeated blocks. ``"auto"``: the largest by parameters (``"dataflow"``: all).
            split_points: Names of the blocks that begin stages 1..N-1. Default ``None``: use ``balance``.
            balance: ``"params"`` (fewest parameters on the largest stage), ``"blocks"`` (even split) or blocks per
                stage (``[3, 5]``). ``"auto"``: by measured cost when the LightningModule has
                ``example_input_array``, else ``"params"``.
            process_group_backend: ``torch.distributed`` backend. Default ``None``: ``"cpu:gloo,cuda:nccl"`` on CUDA,
                ``gloo`` on CPU.
            timeout: Timeout of collective and point-to-point operations. Default 10 minutes (docs/reliability.md).
            init_weights: Weights to start from: a ``.ckpt``, a ``state_dict`` file, a lightning-pipe checkpoint
                directory or a Hugging Face model directory (docs/pretrained.md), each rank reading only its stages'
                tensors. Default ``None``: the model's own init.
            init_adapter: A PEFT adapter directory loaded after ``init_weights``: continue a LoRA fine-tune.
            init_values: The initial values of a network built in ``configure_model``. ``"one_device"`` (default):
                what one device draws with the same seed, the global random stream left where one device leaves it
                (each rank draws the other ranks' values too and discards them). ``"per_unit"``: each unit under its
                own seed, no rank drawing for another (docs/initialization.md).
            eval_microbatches: Microbatches per validation/test/predict batch (any batch size works). ``"auto"``: one
                per process of the pipeline.
            data_parallel: How replicas share the work: ``"ddp"`` (default; stages whole, gradients averaged once per
                optimizer step) or ``"fsdp"`` (each stage sharded over its replicas with FSDP2).
            inner_axis: The mesh axis of consecutive ranks (one node): ``"dp"`` (default) or ``"pp"``.
            activation_checkpointing: Recompute blocks in backward: ``True`` every block, ``k`` every ``k``-th block
                of the stack. Default ``False``.
            tensor_parallel: Processes sharing every stage, each layer split over them (mesh axis ``"tp"``,
                innermost). With more than 1 the network is cut before ``configure_model``, which applies
                ``parallelize_module`` with ``self.device_mesh["tp"]`` to the units this rank holds; a Hugging Face
                model without such a plan gets its own (``base_model_tp_plan``). ``"auto"``: 1. Trainer only.
            loss_parallel: Run each step (the loss and its backward) inside torch's ``loss_parallel()``, for a head
                whose output stays split over the vocabulary. Default ``False``. Trainer only.
            compile: ``torch.compile`` each block in place: ``True`` or a dict of its options (``mode``, ``backend``,
                ...); not with the schedules that split the backward (docs/compile.md). Default ``False``.
            max_restarts: Under Lightning's launcher, how many times every rank is started again after a failure,
                each time resuming ``fit`` from the newest complete checkpoint (torchrun: ``--max-restarts``).
                Default 0. Trainer only.
            snapshot_every: Every how many training steps each rank copies its state to its own and a buddy rank's
                host memory, so that a lost rank is recovered in place by the supervisor of ``max_restarts``
                (docs/reliability.md). 0: no snapshots. Default ``"auto"``: every 20 steps with ``max_restarts``
                under Lightning's launcher, for whole stages (not FSDP, not tensor parallel); none otherwise. Trainer
                only.
            spares: With ``snapshot_every``: processes the supervisor starts with the run, which run the script up to
                ``fit`` and wait to take a lost rank's place (a used one is followed by a new one once its recovery
                completed). Default 0: a new process is started then. Trainer only.
            async_checkpoint: Save checkpoints from a thread: the step waits only while the state is copied to host
                memory. Default ``False``. Trainer only.
            model_plan: The pipeline plan of a transformers model whose family has none, shaped as transformers'
                ``base_model_pp_plan`` (``{"model.layers": (["hidden_states"], ["hidden_states"]), ...}``), names
                relative to the model, in execution order (docs/model-plan.md). Default ``None``: its own plan.
        """
        settings = PipelineSettings(
            pipeline_size=pipeline_size,
            schedule=schedule,
            microbatches=microbatches,
            microbatch_size=microbatch_size,
            stages_per_rank=stages_per_rank,
            module=module,
            frontend=frontend,
            blocks=blocks,
            split_points=split_points,
            balance=balance,
            process_group_backend=process_group_backend,
            timeout=timeout,
            init_weights=init_weights,
            init_adapter=init_adapter,
            init_values=init_values,
            eval_microbatches=eval_microbatches,
            data_parallel=data_parallel,
            inner_axis=inner_axis,
            activation_checkpointing=activation_checkpointing,
            tensor_parallel=tensor_parallel,
            loss_parallel=loss_parallel,
            compile=compile,
            max_restarts=max_restarts,
            snapshot_every=snapshot_every,
            spares=spares,
            async_checkpoint=async_checkpoint,
            model_plan=model_plan,
        )
        self._session = PipelineSession(settings)
        self.init_front_end(settings)

    def init_front_end(self, settings: PipelineSettings) -> None:
        """The front end's own initialisation (its Lightning base class's), with the validated settings."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the session's view
    @property
    def _mesh(self) -> Optional[DeviceMesh]:  # type: ignore[override]
        return self._session.mesh_or_none

    @property
    def _settings(self) -> PipelineSettings:
        return self._session.settings

    @property
    def settings(self) -> PipelineSettings:
        """Every setting, validated; the ``"auto"`` values are resolved once the processes start."""
        return self._session.settings

    def apply_tuned(self, **settings: Any) -> None:
        """Replace settings before the first run (what :func:`lightning_pipe.tune.tune` chose)."""
        self._session.tune(**settings)

    @property
    def pipeline_size(self) -> int:
        """Processes per pipeline (resolved when the processes start)."""
        if not self._settings.resolved:
            raise PipelineUsageError("`pipeline_size` is resolved when the processes start (setup_environment).")
        return int(self._settings.pipeline_size)

    @property
    def data_parallel_size(self) -> int:
        return self._session.data_parallel_size

    @property
    def schedule_name(self) -> str:
        """The schedule's canonical name, or ``"custom schedule <source>"``."""
        return str(self._settings.schedule)

    @property
    def stages_per_rank(self) -> int:
        return int(self._settings.stages_per_rank)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Data is sharded over data-parallel replicas only: every stage of one pipeline must see the same batch.
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def engine(self) -> StepEngine:
        """The step engine (built when the model is set up)."""
        if self._session.engine is None:
            raise PipelineUsageError(self.not_built)
        return self._session.engine

    @property
    def runtime(self) -> PipelineRuntime:
        """The stages this rank runs and their schedule (built when the model is set up)."""
        return self.engine.runtime

    @property
    def gradient_sync(self) -> GradientSync:
        """The once-per-optimizer-step gradient synchronisation (its ``bucket_bytes`` can be set after setup;
        ``count`` and ``last_buckets`` say what it did)."""
        if self._session.gradients is None:
            raise PipelineUsageError(self.not_built)
        return self._session.gradients.sync

    @property
    def checkpointed_blocks(self) -> list[str]:
        """Names (in the network) of this rank's blocks whose activations are recomputed in backward."""
        return list(self._session.wrapped.checkpointed)

    def checkpoint_topology(self) -> ckpt_io.Topology:
        """Where this process sits, as the checkpoint code needs it."""
        return self._session.topology()

    # ------------------------------------------------------------------ devices and collectives over every process
    parallel_devices: Optional[list[torch.device]]
    local_rank: int
    world_size: int

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = pl_compat.sync_ddp_if_available(flag, collectives.world_group(), reduce_op="sum")
        return bool(flag == self.world_size) if all else bool(flag)

    def barrier(self, name: Optional[str] = None) -> None:
        collectives.barrier(collectives.world_group(), device=self.root_device)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return collectives.broadcast_object(obj, src, collectives.world_group(), device=self.root_device)
