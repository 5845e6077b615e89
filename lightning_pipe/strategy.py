"""``PipelineParallelStrategy``: Lightning's Trainer driving ``torch.distributed.pipelining``.

A thin adapter: the settings (:mod:`lightning_pipe.settings`), the split (:mod:`lightning_pipe.split`), the step
(:mod:`lightning_pipe.step`), gradients and wrappers (:mod:`lightning_pipe.parallel`), checkpoints
(:mod:`lightning_pipe.checkpoint`) and failures (:mod:`lightning_pipe.reliability`) do the work; this class wires them
to Lightning's hooks. It owns the process topology (a ``DeviceMesh``, :mod:`lightning_pipe.comm.mesh`) and, per Trainer
entry, the step engine and an exit stack of everything it installed on the user's objects, undone at teardown. Nothing
is left on the LightningModule but the split itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from contextlib import ExitStack, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_pipe.checkpoint import io as ckpt_io
from lightning_pipe.checkpoint import optim as ckpt_optim
from lightning_pipe.checkpoint import resume as ckpt_resume
from lightning_pipe.checkpoint.hooks import CheckpointHooks
from lightning_pipe.comm import collectives
from lightning_pipe.comm import mesh as meshes
from lightning_pipe.compat import lightning as pl_compat
from lightning_pipe.errors import PipelineUsageError
from lightning_pipe.measure.memory import MemoryReport, PeakMemory, SavedBytesRecorder, state_bytes
from lightning_pipe.measure.memory import tensor_parallel_share as tp_share
from lightning_pipe.parallel import data_parallel as dp_modes
from lightning_pipe.parallel.grads import GradientSync, StageGradients, TieGroups, build_optimizers, stage_gradients
from lightning_pipe.parallel.tensor_parallel import TensorParallel
from lightning_pipe.parallel.wrappers import Wrapped, unwrap_stages, wrap_stages
from lightning_pipe.reliability import failures, restart, watchdog
from lightning_pipe.reliability.launcher import PipelineLauncher
from lightning_pipe.scope import quieter_warnings, replaced
from lightning_pipe.settings import (
    DEFAULT_TIMEOUT,
    DP,
    DataParallelMode,
    InnerAxis,
    ModelPlan,
    NonNegativeInt,
    PipelineSettings,
    PositiveInt,
    ScheduleName,
)
from lightning_pipe.split import tied
from lightning_pipe.split.builder import Split, has_network, is_split, split_module
from lightning_pipe.split.deferred_init import InitRecording, record_init
from lightning_pipe.step.engine import StepEngine
from lightning_pipe.step.frontend import HookStep
from lightning_pipe.step.hooks import GradientHooks
from lightning_pipe.step.manual import ManualOptimization
from lightning_pipe.step.metrics import bind_metrics
from lightning_pipe.step.report import (
    announce_parameters,
    check_supported,
    check_training_batches,
    warn_batch_dependent,
)
from lightning_pipe.step.rng import RngStreams
from lightning_pipe.step.runtime import PipelineRuntime

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh


class PipelineParallelStrategy(
    CheckpointHooks, GradientHooks, meshes.MeshAxes, pl_compat.LauncherHook, ParallelStrategy
):
    """Pipeline parallelism for an unchanged LightningModule: ``Trainer(strategy="pipeline")``.

    The network is cut into stages; each process builds and keeps only its own stages (parameter names stay those of
    the full model), and every training step runs as one ``torch.distributed.pipelining`` schedule step. Processes
    beyond one pipeline form data-parallel replicas of it. Every argument is described in docs/strategy.md.

    Arguments:
        pipeline_size: Processes per pipeline. A divisor of the world size; the quotient is the data-parallel size.
            ``"auto"``: all processes.
        schedule: A torch schedule by name, any letter case (``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``LoopedBFS``,
            ``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``). ``"auto"``: ``1F1B`` with one stage per
            rank, ``Interleaved1F1B`` with more.
        microbatches: Microbatches per training batch. A divisor of the batch size. ``"auto"``: the number of stages.
        microbatch_size: Samples per microbatch instead of a count. Default ``None``: use ``microbatches``.
        stages_per_rank: Stages each process holds. ``"auto"``: 1 for ``GPipe``/``1F1B``, 2 for the others (round
            robin, or a V for ``ZBVZeroBubble``/``DualPipeV``).
        module: Attribute holding the network. ``"auto"``: the only child with parameters, else the LightningModule.
        frontend: ``"modules"`` (the forward skips units set to ``None``), ``"dataflow"`` (an unmodified forward on
            every stage, values routed to the stages that read them) or ``"trace"``. ``"auto"``, per network:
            ``"modules"`` for an ``nn.Sequential``, a transformers model or a forward that tests its units against
            ``None``; ``"dataflow"`` otherwise (and for several block stacks); said once on rank 0.
        blocks: The container(s) of repeated blocks. ``"auto"``: the largest by parameters (``"dataflow"``: all).
        split_points: Names of the blocks that begin stages 1..N-1. Default ``None``: use ``balance``.
        balance: ``"params"`` (fewest parameters on the largest stage), ``"blocks"`` (even split) or blocks per stage
            (``[3, 5]``). ``"auto"``: by measured cost when the LightningModule has ``example_input_array``, else
            ``"params"``.
        process_group_backend: ``torch.distributed`` backend. Default ``None``: ``"cpu:gloo,cuda:nccl"`` on CUDA,
            ``gloo`` on CPU.
        timeout: Timeout of collective and point-to-point operations. Default 10 minutes (docs/reliability.md).
        init_weights: Weights to start from: a ``.ckpt``, a ``state_dict`` file, a lightning-pipe checkpoint
            directory or a Hugging Face model directory (docs/pretrained.md), each rank reading only its stages'
            tensors. Default ``None``: the model's own init.
        init_adapter: A PEFT adapter directory loaded after ``init_weights``: continue a LoRA fine-tune (pretrained.md).
        eval_microbatches: Microbatches per validation/test/predict batch (any batch size works). ``"auto"``: one per
            process of the pipeline.
        data_parallel: How replicas share the work: ``"ddp"`` (default; stages whole, gradients averaged once per
            optimizer step) or ``"fsdp"`` (each stage sharded over its replicas with FSDP2).
        inner_axis: The mesh axis of consecutive ranks (one node): ``"dp"`` (default) or ``"pp"``.
        activation_checkpointing: Recompute blocks in backward: ``True`` every block, ``k`` every ``k``-th block of
            the stack. Default ``False``.
        tensor_parallel: Processes sharing every stage, each layer split over them (mesh axis ``"tp"``, innermost).
            With more than 1 the network is cut before ``configure_model``, which applies ``parallelize_module`` with
            ``self.device_mesh["tp"]`` to the units this rank holds; a Hugging Face model without such a plan gets its
            own (``base_model_tp_plan``). ``"auto"``: 1.
        loss_parallel: Run each step (the loss and its backward) inside torch's ``loss_parallel()``, for a head whose
            output stays split over the vocabulary. Default ``False``.
        compile: ``torch.compile`` each block in place: ``True`` or a dict of its options (``mode``, ``backend``, ...);
            not with the schedules that split the backward (docs/compile.md). Default ``False``.
        max_restarts: Under Lightning's launcher, how many times every rank is started again after a failure, each
            time resuming ``fit`` from the newest complete checkpoint (torchrun: ``--max-restarts``). Default 0.
        async_checkpoint: Save checkpoints from a thread: the step waits only while the state is copied to host
            memory. Default ``False``.
        model_plan: The pipeline plan of a transformers model whose family has none, shaped as transformers'
            ``base_model_pp_plan`` (``{"model.layers": (["hidden_states"], ["hidden_states"]), ...}``), names
            relative to the model, in execution order (docs/model-plan.md). Default ``None``: the model's own plan.

    Checkpoints are directories of per-rank ``torch.distributed.checkpoint`` shards under the full model's names: they
    load into any layout, and ``python -m lightning_pipe.checkpoint consolidate`` makes an ordinary ``.ckpt``.
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        pipeline_size: Union[Literal["auto"], PositiveInt] = "auto",
        schedule: ScheduleName = "auto",
        microbatches: Union[Literal["auto"], PositiveInt] = "auto",
        microbatch_size: Optional[PositiveInt] = None,
        stages_per_rank: Union[Literal["auto"], PositiveInt] = "auto",
        module: str = "auto",
        frontend: Literal["auto", "modules", "dataflow", "trace"] = "auto",
        blocks: Union[str, list[str]] = "auto",
        split_points: Optional[list[str]] = None,
        balance: Union[Literal["auto", "params", "blocks"], list[PositiveInt]] = "auto",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = DEFAULT_TIMEOUT,
        init_weights: Optional[Union[str, Path]] = None,
        init_adapter: Optional[Union[str, Path]] = None,
        eval_microbatches: Union[Literal["auto"], PositiveInt] = "auto",
        data_parallel: DataParallelMode = "ddp",
        inner_axis: InnerAxis = "dp",
        activation_checkpointing: Union[bool, NonNegativeInt] = False,
        tensor_parallel: Union[Literal["auto"], PositiveInt] = "auto",
        loss_parallel: bool = False,
        compile: Union[bool, dict[str, Any]] = False,
        max_restarts: NonNegativeInt = 0,
        async_checkpoint: bool = False,
        model_plan: Optional[ModelPlan] = None,
    ) -> None:
        super().__init__()
        # Validated now, so a bad config fails before processes start; "auto" values are resolved in setup_environment.
        arguments = locals()
        self._settings = PipelineSettings(
            **{f.name: arguments[f.name] for f in dataclasses.fields(PipelineSettings) if f.name in arguments}
        )
        self._meshes = meshes.MeshCache()
        self._mesh: Optional[DeviceMesh] = None
        self._engine: Optional[StepEngine] = None
        self._split: Optional[Split] = None
        self._gradients: Optional[StageGradients] = None
        #: a manual-optimization module's optimizer calls (None under automatic optimization)
        self._manual: Optional[ManualOptimization] = None
        self._tie_groups = TieGroups()
        self._wrapped = Wrapped()
        self._saved: dict[int, SavedBytesRecorder] = {}
        self._memory_logged = False
        self._load_peak: Optional[PeakMemory] = None  # measured while `init_weights` was loaded
        self._rng = RngStreams()
        self._init_recording: Optional[InitRecording] = None
        #: what this Trainer entry installed on the user's objects, undone at teardown
        self._run = ExitStack()
        self.num_nodes = 1
        # A rank started by a launcher ends when its launcher does, from now on (docs/reliability.md).
        watchdog.start_if_launched()
        collectives.destroy_at_exit()  # registered before the launch's: rank 0 joins its ranks, then destroys

    # ------------------------------------------------------------------ settings and topology
    @property
    def settings(self) -> PipelineSettings:
        """Every setting of this strategy, validated; the ``"auto"`` values are resolved once the processes start."""
        return self._settings

    @property
    def pipeline_size(self) -> int:
        """Processes per pipeline (resolved in ``setup_environment``)."""
        if not self._settings.resolved:
            raise PipelineUsageError("`pipeline_size` is resolved when the processes start (setup_environment).")
        return int(self._settings.pipeline_size)

    @property
    def data_parallel_size(self) -> int:
        return self._settings.data_parallel_size if self._settings.resolved else 1

    @property
    def schedule_name(self) -> str:
        return self._settings.schedule

    @property
    def stages_per_rank(self) -> int:
        return int(self._settings.stages_per_rank)

    @property
    def gradient_sync(self) -> GradientSync:
        """The once-per-optimizer-step gradient synchronisation (its ``bucket_bytes`` can be set after setup;
        ``count`` and ``last_buckets`` say what it did)."""
        if self._gradients is None:
            raise PipelineUsageError("The gradient synchronisation is built in `Trainer.fit` setup.")
        return self._gradients.sync

    @property
    def checkpointed_blocks(self) -> list[str]:
        """Names (in the network) of this rank's blocks whose activations are recomputed in backward."""
        return list(self._wrapped.checkpointed)

    def apply_tuned(self, **settings: Any) -> None:
        """Replace settings before the Trainer's first entry (what :func:`lightning_pipe.tune.tune` chose)."""
        self._settings = self._settings.tuned(**settings)

    @property
    def runtime(self) -> PipelineRuntime:
        if self._engine is None:
            raise PipelineUsageError(
                "The pipeline is built in `Trainer.fit/validate/...` setup; it does not exist yet."
            )
        return self._engine.runtime

    # ------------------------------------------------------------------ environment
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Shard data across data-parallel replicas only: all stages of one pipeline must see the same batch.
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def is_distributed(self) -> bool:
        """Whether there are data-parallel replicas: Lightning then shards data with a distributed sampler and applies
        ``self.log(..., sync_dist=True)``. The stages of one pipeline need neither: they see the same batches and log
        the same values."""
        return self.data_parallel_size > 1

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._settings.process_group_backend

    def make_launcher(self) -> PipelineLauncher:
        assert self.cluster_environment is not None
        environment, settings = self.cluster_environment, self._settings
        restarts, find = settings.max_restarts, ckpt_resume.find_resume  # a restarted fit resumes by itself
        return PipelineLauncher(environment, self.num_processes, self.num_nodes, settings.timeout, restarts, find)

    @override
    @failures.in_phase("during start-up")
    def setup_environment(self) -> None:
        super().setup_environment()
        # No `reset_seed()` as Lightning's DDP does: every process runs the user's script, seeded as on one device, and
        # re-seeding here would give a shuffling DataLoader another order than that device (see RngStreams).
        self._set_world_ranks()
        self._run = ExitStack()
        backend = self._settings.process_group_backend or collectives.default_backend(self.root_device)
        kwargs: dict[str, Any] = {"timeout": self._settings.timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        if (store := restart.attempt_store(self._settings.timeout)) is not None:
            kwargs["store"] = store  # a restarted torchrun worker: this attempt's keys only
        pl_compat.init_dist_connection(self.cluster_environment, backend, **kwargs)
        self._settings = dataclasses.replace(self._settings, process_group_backend=backend).resolve(self.world_size)
        self._mesh = self._meshes.build(self._settings, self.root_device.type)
        if self.lightning_module is not None:
            self._run.callback(pl_compat.set_device_mesh, self.lightning_module, self.lightning_module.device_mesh)
            pl_compat.set_device_mesh(self.lightning_module, self._mesh)

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Modules created in ``configure_model`` go on the meta device: each rank allocates only its own stages, and
        replays on them what ``configure_model`` did to their tensors (recorded here). With ``tensor_parallel > 1`` a
        network built in ``__init__`` is cut first: ``configure_model`` splits the units this rank holds."""
        module = self.lightning_module
        if self.tensor_parallel_size > 1 and module is not None and has_network(module, self._settings.module):
            self._split_network(module)
            yield
            return
        with torch.device("meta"), record_init() as recording:
            yield
        self._init_recording = recording.finish(self.lightning_module)

    # ------------------------------------------------------------------ setup
    @override
    @failures.in_phase("during start-up")
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._split = split = self._split_network(module)
        self._engine = StepEngine(
            module, split, self._settings, self.pipeline_group, self.root_device, self._rng, self.device_mesh
        )
        self._run.callback(self._close_engine)
        self._run.callback(bind_metrics(module, self.data_parallel_group))
        self._run.enter_context(collectives.picklable_groups())  # the metrics' group pickles and deep-copies
        if fitting and not self._saved:
            self._saved = {s: SavedBytesRecorder(m) for s, m in self.runtime.stages.items()}
        failures.describe(self.global_rank, list(self.runtime.stages))
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        initial = self._settings.init_weights, self._settings.init_adapter
        if initial != (None, None) and self._load_peak is None:  # once (see load_initial_weights)
            self._load_peak = self.load_initial_weights(*initial, split.prefix)
        self._wrap_stages(split)
        # After wrapping (FSDP replaces parameters): this rank's copies of parameters shared across stages.
        ties = self._tie_groups.copies(self._mesh, self._meshes.layout, split, module)
        self._gradients = stage_gradients(module, ties, self.device_mesh, self._wrapped)
        self.barrier()
        if fitting:
            build_optimizers(split.network, module, lambda: self.setup_optimizers(trainer), lambda: self.optimizers)
        self.setup_precision_plugin()
        if fitting:
            pl_compat.optimizers_to_device(self.optimizers, self.root_device)
        # Lightning clips with the norm of this rank's gradients; the right norm spans every stage. Scoped to this
        # entry: the plugin may be the user's object, reused by another Trainer.
        self._run.enter_context(replaced(self.precision_plugin, "clip_grad_by_norm", self._gradients.clip))
        self._run.enter_context(quieter_warnings(self.global_rank, replicated=self.data_parallel_size > 1))
        # Every stage draws the same shuffling order (the processes sharing a stage the same dropout): rank 0 decides.
        self._rng.agree(self.tensor_parallel_group, collectives.group_ranks(self.tensor_parallel_group)[0])
        self._rng.agree(self.pipeline_group, self.runtime.group_ranks[0])
        resumed_from = self.launcher.resumed_from if fitting and isinstance(self.launcher, PipelineLauncher) else None
        self.open_checkpoints(trainer, self._rng, self._settings.async_checkpoint, resumed_from)
        announce_parameters(trainer, module, self.pipeline_group, split)

    def _split_network(self, module: Any) -> Split:
        """This rank's stages: cut now (in place, replaying ``configure_model``'s recorded initialisation) or found
        from an earlier cut (:func:`split_module`)."""
        check_supported(module, self.precision_plugin)
        # Single-device checkpoints number parameters in the full model's optimizer order: record it before the split.
        if module.trainer.state.fn == TrainerFn.FITTING and not is_split(module):
            ckpt_optim.record_param_groups(module)
        recording, self._init_recording = self._init_recording, None  # replayed: its meta tensors can go
        return split_module(
            module,
            self._settings,
            pipeline_rank=self.pipeline_rank,
            device=self.root_device,
            agree=lambda value: collectives.broadcast_object(value, 0, self._world, device=self.root_device),
            announce=rank_zero_info,
            recording=recording,
        )

    @property
    def _world(self) -> Any:
        return collectives.world_group()

    def _wrap_stages(self, split: Split) -> None:
        """Tensor parallelism, activation checkpointing and FSDP on this rank's stages (:func:`wrap_stages`), before the
        optimizers are created: they must hold the sharded parameters."""
        stages = self.runtime.stages
        self._wrapped = wrap_stages(
            stages,
            split.block_names,
            checkpoint_every=self._settings.activation_checkpointing,
            compile_options=self._settings.compile,
            dp_mesh=self.device_mesh[DP] if self._settings.sharded else None,
            sharded_over=split.sharded_over,
            tensor_parallel=TensorParallel(split, self.device_mesh) if self.tensor_parallel_size > 1 else None,
        )
        split.sharded_over, split.tensor_parallel = self._wrapped.sharded_over, self._wrapped.tensor_parallel
        self._run.callback(unwrap_stages, stages)

    def _close_engine(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self._engine = None

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def on_train_start(self) -> None:
        """Before the first batch: a loader whose batches cannot be split into equal microbatches fails now, with one
        message, instead of at the end of the first epoch."""
        trainer = self.lightning_module.trainer
        check_training_batches(trainer, self._settings, self.global_rank)
        assert self._split is not None
        warn_batch_dependent(trainer, self._settings, self._split, self.pipeline_group)

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        engine = self._require_engine("training_step", kwargs)
        module = self.lightning_module
        assert self._gradients is not None
        # Manual optimization: the step's optimizer calls are recorded while the schedule runs, and done after it.
        self._manual = manual = ManualOptimization.of(module, self._manual, self._gradients.synchronize)
        step = manual.user_step(args[1:]) if manual else HookStep(module, "training_step", tuple(args[1:]))
        accumulate = module.trainer.accumulate_grad_batches
        released = [] if manual else pl_compat.gradients_zeroed_after_step(module.trainer)
        with self.precision_plugin.train_step_context(), self._gradients.capture(released):
            with manual.recorded() if manual else nullcontext():
                outcome = engine.train(step, args[0], accumulate)
        window = f"`accumulate_grad_batches={accumulate}`" if accumulate > 1 else None
        dp_modes.check_token_weighting(self._settings, outcome.grad_scale, self.data_parallel_group, window)
        self._gradients.stash.scale = outcome.grad_scale
        shown = outcome.output_shared or engine.runtime.has_last
        if manual:
            manual.run(outcome)
            return outcome.output if shown else outcome.loss
        if outcome.output is not None and shown:
            return outcome.output
        return outcome.loss

    def _require_engine(self, hook: str, kwargs: dict[str, Any]) -> StepEngine:
        if kwargs:
            raise PipelineUsageError(f"Unexpected keyword arguments for {hook}: {sorted(kwargs)}.")
        assert self._engine is not None, "setup builds the engine"
        return self._engine

    @property
    def memory_report(self) -> MemoryReport:
        """What this rank holds: parameter, gradient and optimizer-state bytes now, bytes saved for backward per
        microbatch by each local stage (measured on the first training forward), and the peak allocated while its
        stages were built (``configure_model`` construction) and while ``init_weights`` was loaded. Logged once, after
        the first optimizer step."""
        assert self._split is not None
        return MemoryReport(
            rank=self.global_rank,
            stages=tuple(self._split.bodies),
            state=state_bytes(self.model, self.optimizers),
            saved_per_microbatch={s: r.bytes for s, r in self._saved.items() if r.bytes is not None},
            construction_peak=self._split.construction_peak,
            tensor_parallel=tp_share(self.model, self.tensor_parallel_rank, self.tensor_parallel_size),
            load_peak=self._load_peak,
        )

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._eval_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._eval_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The batch's predictions on pipeline rank 0 of each replica (global rank 0 without data parallelism), where
        ``trainer.predict`` returns them; ``None`` on the other ranks."""
        with self.precision_plugin.predict_step_context():
            return self._eval_step("predict_step", args, kwargs)

    def _eval_step(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        engine = self._require_engine(hook, kwargs)
        outcome = engine.evaluate(HookStep(self.lightning_module, hook, tuple(args[1:])), args[0])
        if self._wrapped.sharded:
            dp_modes.reshard(engine.runtime.stages.values())
        if hook == "predict_step":
            return engine.runtime.to_first_rank(outcome.output)
        return outcome.output if engine.runtime.has_last or outcome.output_shared else None

    # ------------------------------------------------------------------ checkpoints (lightning_pipe.checkpoint.hooks)
    def checkpoint_network(self) -> tuple[str, Optional[torch.nn.Module]]:
        return (self._split.network_attr, self._split.network) if self._split is not None else ("", None)

    def checkpoint_topology(self) -> ckpt_io.Topology:
        # Every tied parameter once, under its first name, whether its names are on one stage or several: the
        # checkpoint is then the same for every layout.
        aliases = tied.aliases(self._split.shared, self._split.prefix) if self._split is not None else {}
        return ckpt_io.Topology(
            global_rank=self.global_rank,
            world_size=self.world_size,
            pipeline_rank=self.pipeline_rank,
            pipeline_size=self.pipeline_size,
            data_parallel_rank=self.data_parallel_rank,
            data_parallel_size=self.data_parallel_size,
            stages_per_rank=self.stages_per_rank,
            schedule=self.schedule_name,
            pipeline_group=self.pipeline_group,
            aliases=aliases,
            sharded=self._wrapped.sharded,
            tensor_parallel_rank=self.tensor_parallel_rank,
            tensor_parallel_size=self.tensor_parallel_size,
            replica_group=self._meshes.replica_group,
            network_prefix=self._split.prefix if self._split is not None else "",
        )

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        collectives.barrier(self._world, device=self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return collectives.broadcast_object(obj, src, self._world, device=self.root_device)

    @override
    def reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Union[Tensor, Any]:
        """Reduce across data-parallel replicas (every stage of a pipeline already holds the same logged value)."""
        if isinstance(tensor, Tensor):
            group = group if group is not None else self.data_parallel_group
            return pl_compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = pl_compat.sync_ddp_if_available(flag, self._world, reduce_op=ReduceOp.SUM)
        return bool(flag == self.world_size) if all else bool(flag)

    @override
    @failures.in_phase("during teardown")
    def teardown(self) -> None:
        self.close_checkpoints()  # pending saves complete (or are dropped after a failure)
        # Undo what this entry installed on the user's objects (interceptor, metric groups, clipping, wrappers).
        self._run.close()
        for recorder in self._saved.values():
            recorder.remove()
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Pipeline parallelism (torch.distributed.pipelining)"
        )
