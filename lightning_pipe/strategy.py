"""``PipelineParallelStrategy``: Lightning's Trainer driving ``torch.distributed.pipelining``.

The strategy wires Lightning to the pieces that do the work: the split (:mod:`lightning_pipe.builder`), the step
protocol (:mod:`lightning_pipe.protocol`) with its executors, gradients (:mod:`lightning_pipe.grads`) and checkpoints
(:mod:`lightning_pipe.checkpoint`). It owns the process topology (a ``DeviceMesh``, :mod:`lightning_pipe.mesh`) and the
pipeline runtime; nothing is stored on the LightningModule but the split itself.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_pipe import builder, collectives, failures, tied, transport, watchdog, wrappers
from lightning_pipe import data_parallel as dp_modes
from lightning_pipe import mesh as meshes
from lightning_pipe.checkpoint import io as ckpt_io
from lightning_pipe.checkpoint import optim as ckpt_optim
from lightning_pipe.checkpointing import resolve_every
from lightning_pipe.compat import lightning as pl_compat
from lightning_pipe.config import (
    NonNegativeInt,
    PositiveInt,
    ScheduleName,
    check_balance_setting,
    check_microbatch_settings,
    check_pipeline_size,
    resolve_pipeline_size,
    resolve_schedule,
)
from lightning_pipe.errors import PipelineConfigError, PipelineUsageError
from lightning_pipe.executors import ForwardOnlyExecutor, ScheduleExecutor
from lightning_pipe.executors.forward_only import check_eval_microbatches
from lightning_pipe.grads import GradientStash, GradientSync, TiedCopy, clip_grad_norm_across
from lightning_pipe.interception import CallInterceptor
from lightning_pipe.memory import MemoryReport, SavedBytesRecorder, state_bytes
from lightning_pipe.metrics import MetricMirror, bind_metrics
from lightning_pipe.protocol import RngStreams, StepProtocol
from lightning_pipe.runtime import PipelineRuntime
from lightning_pipe.side_inputs import CallBook

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh


# A child of Lightning's logger: its lines appear wherever Lightning's own INFO lines do.
log = logging.getLogger("lightning.pytorch.lightning_pipe")


class PipelineParallelStrategy(ParallelStrategy):
    """Pipeline parallelism for an unchanged LightningModule: ``Trainer(strategy="pipeline")``.

    The network is cut into stages; each process builds and keeps only its own stages (parameter names stay those of
    the full model), and every training step runs as one ``torch.distributed.pipelining`` schedule step. Processes
    beyond one pipeline form data-parallel replicas of it.

    Arguments:
        pipeline_size: Processes per pipeline. ``"auto"``: all processes (``devices * num_nodes``), no data
            parallelism. The world size must be a multiple of it; the quotient is the data-parallel size.
        schedule: A torch schedule by name (``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``LoopedBFS``,
            ``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``; any letter case). ``"auto"``: ``1F1B`` with one
            stage per rank, ``Interleaved1F1B`` with more.
        microbatches: Microbatches per training batch. ``"auto"``: the number of stages (the fewest that fill the
            pipeline). The batch size must be a multiple of it.
        microbatch_size: Samples per microbatch instead of a count (the count then follows each batch's size).
        stages_per_rank: Stages each process holds. ``"auto"``: 1 for ``GPipe``/``1F1B``, 2 for the multi-stage
            schedules (placed round robin, or in a V for ``ZBVZeroBubble``/``DualPipeV``).
        module: Attribute of the LightningModule that holds the network to pipeline. ``"auto"``: the only child module
            with parameters, or the LightningModule itself when several children have parameters.
        frontend: How stages are cut. ``"modules"``: the network's own ``forward`` runs on each stage with other
            stages' units set to ``None`` (an ``nn.Sequential`` needs no change; other networks skip ``None`` units).
            ``"trace"``: torch's tracer cuts an unmodified network, from ``example_input_array``. ``"auto"``:
            ``"modules"``.
        blocks: Name (inside ``module``) of the ``nn.ModuleList``/``nn.ModuleDict``/``nn.Sequential`` of repeated
            blocks. ``"auto"``: the largest such container by parameter count.
        split_points: Names of the blocks that begin stages 1..N-1 (e.g. ``["layers.4"]``). Default: even split.
        balance: How blocks are shared out when ``split_points`` is not given. ``"auto"``: by measured cost when the
            LightningModule has ``example_input_array`` (each unit's forward and backward time on one microbatch, its
            parameters and activations; the embedding and head count with their stages, which may then hold no
            block), else as ``"params"``. ``"params"``: the fewest parameters on the largest stage. ``"blocks"``: an
            even split by block count. A list gives the blocks per stage (e.g. ``[3, 5]``). Rank 0 prints the split.
        process_group_backend: ``torch.distributed`` backend. ``None``: ``"cpu:gloo,cuda:nccl"`` on CUDA (NCCL for
            activations and gradients, gloo for the few CPU tensors a step sends: a pure ``nccl`` group rejects CPU
            tensors), ``gloo`` on CPU.
        timeout: Timeout of collective and point-to-point operations. Default 10 minutes (torch's is 30): see
            docs/reliability.md. A rank that raises or dies ends the run within seconds whatever the timeout; it only
            bounds waits on a rank that hangs without failing.
        init_weights: Weights to start from instead of the model's own initialisation: a Lightning ``.ckpt`` file, a
            file holding a plain ``state_dict`` (of the LightningModule, or of the network alone, e.g. pretrained
            weights), or a lightning-pipe checkpoint directory. Loaded after the split, before the optimizers are
            created; each rank reads only its own stages' tensors (a file is memory-mapped). Optimizer, scheduler and
            loop state are not restored: resume a run with ``trainer.fit(ckpt_path=...)`` instead.
        eval_microbatches: Microbatches per validation/test/predict batch. ``"auto"``: one per process of the
            pipeline (``pipeline_size``). Evaluation runs a forward-only pass of its own (any schedule, no gradients,
            modules in eval mode) whose microbatches may differ in size, so any batch size works; a batch smaller
            than the setting runs as single-sample microbatches. Not used with ``frontend="trace"``, whose graphs fix
            the microbatch size (a short one is padded). See docs/evaluation.md.
        data_parallel: How the data-parallel replicas of a pipeline (world size / ``pipeline_size``) share the work.
            ``"ddp"``: each replica holds its stages whole; gradients are averaged once per optimizer step in buckets.
            ``"fsdp"``: each stage is sharded over its replicas with FSDP2 ``fully_shard`` (one unit per block and
            the stage's rest), so parameters, gradients and optimizer state take 1/replicas of the memory; gradients
            are reduce-scattered once per optimizer step. Ignored without replicas. See docs/data-parallel.md.
        inner_axis: The mesh axis whose ranks are consecutive, and so share a node: ``"dp"`` (the replicas of each
            stage; gradient all-reduce and FSDP's all-gathers stay inside a node, only activations cross nodes) or
            ``"pp"`` (the stages of each pipeline).
        activation_checkpointing: Recompute blocks' activations in backward instead of keeping them: ``True`` for
            every block, an int ``k`` for every ``k``-th block of the block stack (counted over the whole stack),
            ``False`` or ``0`` for none. See docs/memory.md.

    Checkpoints are directories: each rank writes its own stages' model and optimizer entries with
    ``torch.distributed.checkpoint`` under the full model's names, so they load into any pipeline layout (or one
    process with ``pipeline_size=1``). ``python -m lightning_pipe.checkpoint consolidate`` turns one into an ordinary
    single-file ``.ckpt``. See docs/checkpoints.md.
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
        frontend: Literal["auto", "modules", "trace"] = "auto",
        blocks: str = "auto",
        split_points: Optional[list[str]] = None,
        balance: Union[Literal["auto", "params", "blocks"], list[PositiveInt]] = "auto",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = watchdog.DEFAULT_TIMEOUT,
        init_weights: Optional[Union[str, Path]] = None,
        eval_microbatches: Union[Literal["auto"], PositiveInt] = "auto",
        data_parallel: dp_modes.DataParallelMode = "ddp",
        inner_axis: meshes.InnerAxis = "dp",
        activation_checkpointing: Union[bool, NonNegativeInt] = False,
    ) -> None:
        super().__init__()
        # Validate what needs no world size now, so a bad config fails before processes start.
        check_pipeline_size(pipeline_size)
        resolve_schedule(schedule, stages_per_rank)
        check_microbatch_settings(microbatches, microbatch_size)
        check_eval_microbatches(eval_microbatches)
        check_balance_setting(balance)
        if split_points is not None and not isinstance(balance, str):
            raise PipelineConfigError("Set either `split_points` or `balance`, not both.")
        if frontend not in ("auto", "modules", "trace"):
            raise PipelineConfigError(f"`frontend={frontend!r}` is not one of 'auto', 'modules', 'trace'.")
        dp_modes.check_mode(data_parallel)
        meshes.check_inner_axis(inner_axis)
        self._checkpoint_every = resolve_every(activation_checkpointing)
        self._data_parallel = data_parallel
        self._inner_axis = inner_axis
        self._pipeline_size = pipeline_size
        self._schedule_name = schedule
        self._microbatches = microbatches
        self._microbatch_size = microbatch_size
        self._stages_per_rank = stages_per_rank
        self._module_name = module
        self._frontend = "modules" if frontend == "auto" else frontend
        self._blocks = blocks
        self._split_points = split_points
        self._balance = balance
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._init_weights = init_weights
        self._eval_microbatches = eval_microbatches
        self._data_parallel_size = 1
        self._mesh: Optional[DeviceMesh] = None
        self._mesh_world: Any = None
        self._runtime: Optional[PipelineRuntime] = None
        self._protocol: Optional[StepProtocol] = None
        self._train_executor: Optional[ScheduleExecutor] = None
        self._eval_executor: Optional[ForwardOnlyExecutor] = None
        self._grads = GradientStash()
        self._grad_sync = GradientSync(None)
        self._ties: list[TiedCopy] = []
        self._aliases: dict[str, str] = {}
        self._split: Optional[builder.Split] = None
        self._saved: dict[int, SavedBytesRecorder] = {}
        self._memory_logged = False
        self._tie_groups: Optional[tuple[Any, dict]] = None
        self._mesh_layout = meshes.MeshLayout(1, 1)
        self._wrapped = wrappers.Wrapped()
        self._sharded_params: list[torch.nn.Parameter] = []
        self._rng = RngStreams()
        self.num_nodes = 1

    # ------------------------------------------------------------------ resolved settings
    @property
    def pipeline_size(self) -> int:
        """Processes per pipeline (resolved in ``setup_environment``)."""
        if self._pipeline_size == "auto":
            raise PipelineUsageError("`pipeline_size` is resolved when the processes start (setup_environment).")
        return int(self._pipeline_size)

    @property
    def data_parallel_size(self) -> int:
        return self._data_parallel_size

    @property
    def schedule_name(self) -> str:
        return str(self._schedule_name)

    @property
    def stages_per_rank(self) -> int:
        return int(self._stages_per_rank)  # type: ignore[arg-type]

    @property
    def device_mesh(self) -> DeviceMesh:
        """The process topology: axes ``"dp"`` (data-parallel replicas) and ``"pp"`` (stages of one pipeline)."""
        if self._mesh is None:
            raise PipelineUsageError("The device mesh is built when the processes start (setup_environment).")
        return self._mesh

    @property
    def pipeline_rank(self) -> int:
        return meshes.axis_rank(self.device_mesh, meshes.PP) if self._mesh is not None else 0

    @property
    def data_parallel_rank(self) -> int:
        return meshes.axis_rank(self.device_mesh, meshes.DP) if self._mesh is not None else 0

    @property
    def pipeline_group(self) -> Any:
        return meshes.axis_group(self.device_mesh, meshes.PP)

    @property
    def data_parallel_group(self) -> Any:
        return meshes.axis_group(self.device_mesh, meshes.DP)

    @property
    def gradient_sync(self) -> GradientSync:
        """The data-parallel gradient synchronisation of ``data_parallel="ddp"`` (its ``bucket_bytes`` can be set
        after setup; ``count`` and ``last_buckets`` say what it did)."""
        return self._grad_sync

    @property
    def checkpointed_blocks(self) -> list[str]:
        """Names (in the network) of this rank's blocks whose activations are recomputed in backward."""
        return list(self._wrapped.checkpointed)

    @property
    def runtime(self) -> PipelineRuntime:
        if self._runtime is None:
            raise PipelineUsageError(
                "The pipeline is built in `Trainer.fit/validate/...` setup; it does not exist yet."
            )
        return self._runtime

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
        return {"num_replicas": self._data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def is_distributed(self) -> bool:
        """Whether there are data-parallel replicas: Lightning then shards data with a distributed sampler and applies
        ``self.log(..., sync_dist=True)``. The stages of one pipeline need neither: they see the same batches and log
        the same values."""
        return self._data_parallel_size > 1

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = watchdog.PipelineLauncher(
            self.cluster_environment, self.num_processes, self.num_nodes, self._timeout
        )

    @override
    @failures.in_phase("during start-up")
    def setup_environment(self) -> None:
        super().setup_environment()
        # No `reset_seed()` as Lightning's DDP does: every process runs the user's script, seeded as on one device, and
        # re-seeding here would give a shuffling DataLoader another order than that device (see RngStreams).
        self._set_world_ranks()
        if self._process_group_backend is None:
            self._process_group_backend = default_backend(self.root_device)
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        pl_compat.init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        pp, dp = resolve_pipeline_size(self._pipeline_size, self.world_size)
        self._pipeline_size, self._data_parallel_size = pp, dp
        self._schedule_name, self._stages_per_rank = resolve_schedule(self._schedule_name, self._stages_per_rank)
        self._mesh_layout = meshes.MeshLayout(pp, dp, self._inner_axis)
        self._build_mesh(self._mesh_layout)
        if self.lightning_module is not None:
            pl_compat.set_device_mesh(self.lightning_module, self._mesh)

    def _build_mesh(self, layout: meshes.MeshLayout) -> None:
        # One mesh per default process group: later entries (fit -> validate -> test) reuse its groups.
        world = collectives.world_group()
        if self._mesh is not None and self._mesh_world is world:
            return
        self._mesh = meshes.build_mesh(layout, self.root_device.type)
        self._mesh_world = world

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Modules created in ``configure_model`` go on the meta device: each rank allocates only its own stages."""
        with torch.device("meta"):
            yield

    # ------------------------------------------------------------------ setup
    @override
    @failures.in_phase("during start-up")
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        lightning_module = self.lightning_module
        assert lightning_module is not None
        self._check_supported(lightning_module)
        # Single-device checkpoints number parameters in the full model's optimizer order: record it before the split.
        if trainer.state.fn == TrainerFn.FITTING and not builder.is_split(lightning_module):
            ckpt_optim.record_param_groups(lightning_module)
        split = builder.split_module(
            lightning_module,
            module_name=self._module_name,
            frontend=self._frontend,
            blocks=self._blocks,
            split_points=self._split_points,
            balance=self._balance,
            pipeline_size=self.pipeline_size,
            pipeline_rank=self.pipeline_rank,
            stages_per_rank=self.stages_per_rank,
            schedule=self.schedule_name,
            microbatches=self._microbatches,
            microbatch_size=self._microbatch_size,
            device=self.root_device,
            agree=lambda value: collectives.broadcast_object(value, 0, device=self.root_device),
            announce=rank_zero_info,
        )
        self._split = split
        self._build_runtime(split)
        if trainer.state.fn == TrainerFn.FITTING and not self._saved:
            self._saved = {s: SavedBytesRecorder(m) for s, m in self.runtime.stages.items()}
        failures.describe(self.global_rank, list(self.runtime.stages))
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._init_weights is not None:
            self._load_initial_weights(split.network_attr)
        self._wrap_stages(split)
        # After wrapping (FSDP replaces parameters): this rank's copies of parameters shared across stages.
        self._ties = self._tied_copies(split)
        self._grad_sync.ties = self._ties
        for tie in self._ties:
            tie.agree()  # copies initialised per module (meta construction) start from the first stage's values
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            pl_compat.optimizers_to_device(self.optimizers, self.root_device)
        # Lightning clips with the norm of this rank's gradients; the right norm spans every stage.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        # Every stage must draw the same shuffling order; rank 0 of the pipeline decides it.
        self._rng.agree(self.pipeline_group, self.runtime.group_ranks[0])

    def _check_supported(self, lightning_module: Any) -> None:
        if not lightning_module.automatic_optimization:
            raise PipelineUsageError(
                "PipelineParallelStrategy needs automatic optimization: the schedule runs forward and backward for"
                " you, so `manual_backward` has nothing to act on. Remove `self.automatic_optimization = False` and"
                " return the loss from `training_step`."
            )
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            raise PipelineConfigError(
                f"`precision={self.precision_plugin.precision!r}` needs a gradient scaler whose inf/NaN checks would"
                " have to agree across stages; it is not supported. Use `precision='bf16-mixed'` (or '32-true',"
                " 'bf16-true')."
            )

    def _build_runtime(self, split: builder.Split) -> None:
        self._close_runtime()
        book = CallBook()
        # A one-rank pipeline beside replicas still needs its own group: torch would otherwise pipeline over the world.
        pp_group = self.pipeline_group if self.pipeline_size > 1 or self._data_parallel_size > 1 else None
        runtime = PipelineRuntime(
            builder.stage_modules(split, book),
            split.num_stages,
            split.stage_ranks,
            book,
            pp_group,
            collectives.group_ranks(self.pipeline_group),
            self.root_device,
        )
        bind_metrics(self.lightning_module, self.data_parallel_group)
        self._aliases = tied.aliases(split.ties, f"{split.network_attr}." if split.network_attr else "")
        replicated = self._data_parallel_size > 1 and not dp_modes.shards(self._data_parallel, self._data_parallel_size)
        self._grad_sync = GradientSync(self.data_parallel_group if replicated else None)
        self._runtime = runtime
        self._protocol = StepProtocol(
            self.lightning_module,
            runtime,
            CallInterceptor(split.network),
            MetricMirror(self.lightning_module),
            self._rng,
        )
        self._train_executor = ScheduleExecutor(runtime, self.schedule_name, self._microbatches, self._microbatch_size)
        self._eval_executor = ForwardOnlyExecutor(runtime, self._eval_microbatches, split.static_microbatch_size)

    def _tied_copies(self, split: builder.Split) -> list[TiedCopy]:
        """This rank's copies of parameters shared across stages, each with the group of the ranks holding one.

        Groups are made once per mesh (every rank creates every group, in one order) and reused by later entries.
        """
        if self._tie_groups is None or self._tie_groups[0] is not self._mesh:
            layout, groups = self._mesh_layout, {}
            for tie in split.ties:
                owners = sorted({split.stage_ranks[s] for s in tie.stages})
                if len(owners) < 2:
                    continue  # every stage sharing it lives on one rank: one Parameter object, nothing to sum
                for replica in range(layout.data_parallel_size):
                    ranks = [layout.rank(replica, p) for p in owners]
                    group = collectives.new_group(ranks)
                    if self.global_rank in ranks:
                        source = layout.rank(replica, split.stage_ranks[tie.stages[0]])
                        groups[tie.names] = (group, source)
            self._tie_groups = (self._mesh, groups)
        prefix = f"{split.network_attr}." if split.network_attr else ""
        local = dict(self.lightning_module.named_parameters(remove_duplicate=False))
        copies = []
        for tie in split.ties:
            if tie.names not in self._tie_groups[1]:
                continue
            param = next(local[prefix + n] for n in tie.names if prefix + n in local)
            group, source = self._tie_groups[1][tie.names]
            copies.append(TiedCopy(param, group, source))
        return copies

    def _wrap_stages(self, split: builder.Split) -> None:
        """Activation checkpointing and FSDP on this rank's stages (:func:`lightning_pipe.wrappers.wrap_stages`),
        before the optimizers are created: they must hold the sharded parameters."""
        sharded = dp_modes.shards(self._data_parallel, self._data_parallel_size)
        self._wrapped = wrappers.wrap_stages(
            self.runtime.stages,
            split.block_names,
            checkpoint_every=self._checkpoint_every,
            dp_mesh=self.device_mesh[meshes.DP] if sharded else None,
        )
        self._sharded_params = dp_modes.parameters([self.lightning_module]) if self._wrapped.sharded else []

    def _gradient_params(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients a training step hands over to ``backward``. With FSDP: the sharded ones,
        which receive the reduce-scattered gradients (inside an accumulation window the registered parameters are
        FSDP's unsharded ones, whose gradients keep accumulating untouched until the window's last batch)."""
        if self._wrapped.sharded:
            return self._sharded_params
        return [p for p in self.lightning_module.parameters() if p.requires_grad]

    def _close_runtime(self) -> None:
        if self._protocol is not None:
            self._protocol.interceptor.remove()
            self._protocol.mirror.close()
            self._protocol.channel.close()
        self._runtime = self._protocol = self._train_executor = self._eval_executor = None

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise PipelineUsageError(f"Unexpected keyword arguments for training_step: {sorted(kwargs)}.")
        assert self._protocol is not None and self._train_executor is not None
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        with self.precision_plugin.train_step_context(), self._grads.capture(self._gradient_params()):
            outcome = self._protocol.run("training_step", args[0], tuple(args[1:]), self._train_executor, accumulate)
        dp_modes.check_token_weighting(self._data_parallel, self._data_parallel_size, accumulate, outcome.grad_scale)
        self._grads.scale = outcome.grad_scale
        if outcome.output is not None and (outcome.output_shared or self.runtime.has_last):
            return outcome.output
        return outcome.loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The schedule already ran backward in ``training_step``; here its gradients land after Lightning's
        ``zero_grad``, exactly where a single-device backward would put them."""
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._grads.apply()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Synchronise gradients once per optimizer step: after the closure (the accumulation window's last
        ``training_step`` and ``backward``), before Lightning clips them and steps."""

        def closure_then_sync() -> Any:
            result = closure()
            self._grad_sync.synchronize([p for g in optimizer.param_groups for p in g["params"]])
            return result

        stepped = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
        if not self._memory_logged:
            # After the first step: optimizers such as Adam create their state then.
            self._memory_logged = True
            for line in self.memory_report.lines():
                log.info(line)
        return stepped

    @property
    def memory_report(self) -> MemoryReport:
        """What this rank holds: parameter, gradient and optimizer-state bytes now, bytes saved for backward per
        microbatch by each local stage (measured on the first training forward), and the peak allocated while its
        stages were built (``configure_model`` construction). Logged once, after the first optimizer step."""
        assert self._split is not None
        return MemoryReport(
            rank=self.global_rank,
            stages=tuple(self._split.bodies),
            state=state_bytes(self.model, self.optimizers),
            saved_per_microbatch={s: r.bytes for s, r in self._saved.items() if r.bytes is not None},
            construction_peak=self._split.construction_peak,
        )

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning runs the batches of an accumulation window before its last inside this: FSDP stages then keep
        their gradients unsynchronised (``"ddp"`` synchronises in ``optimizer_step`` only anyway)."""
        stages = list(self.runtime.stages.values()) if self._runtime is not None else []
        for stage in stages:
            stage.sync_gradients = False
        try:
            yield
        finally:
            for stage in stages:
                stage.sync_gradients = True

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
        if kwargs:
            raise PipelineUsageError(f"Unexpected keyword arguments for {hook}: {sorted(kwargs)}.")
        assert self._protocol is not None and self._eval_executor is not None
        outcome = self._protocol.run(hook, args[0], tuple(args[1:]), self._eval_executor)
        if self._wrapped.sharded:
            dp_modes.reshard(self.runtime.stages.values())
        if hook == "predict_step":
            return self._predictions_to_first_rank(outcome.output)
        return outcome.output if self.runtime.has_last or outcome.output_shared else None

    def _predictions_to_first_rank(self, output: Any) -> Any:
        """The last stage's predictions, moved once to pipeline rank 0 when the last stage lives elsewhere."""
        runtime = self.runtime
        source = runtime.stage_ranks[runtime.num_stages - 1]
        me = runtime.pipeline_rank
        if source == 0:
            return output if me == 0 else None
        if runtime.has_last:
            transport.wait_all(transport.send_object(output, runtime.group_ranks[0], runtime.group, runtime.device))
            return None
        if me == 0:
            return transport.recv_object(runtime.last_stage_global_rank, runtime.group, runtime.device)
        return None

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: Union[int, float]) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # Sharded gradients: the squares of every rank's shard add up over the whole mesh.
        if self._wrapped.sharded:
            group = collectives.world_group()
        else:
            group = self.pipeline_group if self.pipeline_size > 1 else None
        copies = [t.param for t in self._ties if t.source != self.global_rank]
        clip_grad_norm_across(params, float(clip_val), group, not_counted=copies)

    # ------------------------------------------------------------------ checkpoints (lightning_pipe.checkpoint)
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # A rank holds only its stages, which exist only after the split in `setup`.
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        # `load_checkpoint` restores the optimizers itself (by parameter name, whatever the layout at save time).
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's stages' entries, under the full model's names."""
        assert self.model is not None
        return ckpt_io.model_state(self.model, self._aliases)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's optimizer state, flattened and keyed by parameter name."""
        assert self.model is not None
        return ckpt_io.optimizer_state(
            self.model, optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer, self._aliases
        )

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # `load_checkpoint` already loaded this rank's weights

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # `load_checkpoint` already loaded this rank's optimizer states

    @override
    @failures.in_phase("while saving a checkpoint")
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Union[str, Path], storage_options: Optional[Any] = None
    ) -> None:
        """Save ``checkpoint`` as the directory ``filepath`` (atomically; see docs/checkpoints.md)."""
        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported: checkpoints are"
                " written with torch.distributed.checkpoint, not a CheckpointIO plugin. Remove `storage_options`."
            )
        path, token = self.broadcast((Path(filepath), uuid.uuid4().hex[:12]))
        module = self.lightning_module
        cls = type(module)
        ckpt_io.save(
            checkpoint,
            path,
            self._checkpoint_topology(),
            token,
            f"{cls.__module__}.{cls.__qualname__}",
            param_groups=ckpt_optim.recorded_param_groups(module),
        )

    @override
    def load_checkpoint(self, checkpoint_path: Union[str, Path], weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a directory checkpoint or a single-device ``.ckpt`` into this rank's stages (model, and optimizers
        when fitting); returns Lightning's remaining checkpoint state."""
        path = Path(self.broadcast(checkpoint_path))
        module = self.lightning_module
        assert module is not None and self.model is not None
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        if path.is_dir() or not path.exists():
            return ckpt_io.load(
                path,
                self._checkpoint_topology(),
                self.model,
                self.optimizers if fitting else [],
                strict=module.strict_loading,
                weights_only=weights_only,
            )
        if fitting:
            return ckpt_io.resume_from_file(
                path,
                self._checkpoint_topology(),
                self.model,
                self.optimizers,
                ckpt_optim.recorded_param_groups(module),
                strict=module.strict_loading,
                weights_only=weights_only,
            )
        return ckpt_io.load_weights(
            path, self._checkpoint_topology(), self.model, network_prefix="", strict=module.strict_loading
        )

    @override
    def remove_checkpoint(self, filepath: Union[str, Path]) -> None:
        """Delete a checkpoint directory (or file) on global rank 0; never a save's temporary directory."""
        if self.is_global_zero:
            ckpt_io.remove(Path(filepath), uuid.uuid4().hex[:12])

    def _checkpoint_topology(self) -> ckpt_io.Topology:
        return ckpt_io.Topology(
            global_rank=self.global_rank,
            world_size=self.world_size,
            pipeline_rank=self.pipeline_rank,
            pipeline_size=self.pipeline_size,
            data_parallel_rank=self.data_parallel_rank,
            data_parallel_size=self._data_parallel_size,
            stages_per_rank=self.stages_per_rank,
            schedule=self.schedule_name,
            pipeline_group=self.pipeline_group if self.pipeline_size > 1 else None,
            aliases=self._aliases,
            sharded=self._wrapped.sharded,
        )

    def _load_initial_weights(self, network_attr: str) -> None:
        assert self.model is not None and self._init_weights is not None
        ckpt_io.load_weights(
            Path(self._init_weights),
            self._checkpoint_topology(),
            self.model,
            network_prefix=f"{network_attr}." if network_attr else "",
            strict=self.lightning_module.strict_loading,
        )

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        collectives.barrier(device=self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return collectives.broadcast_object(obj, src, device=self.root_device)

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
        flag = pl_compat.sync_ddp_if_available(flag, None, reduce_op=ReduceOp.SUM)
        return bool(flag == self.world_size) if all else bool(flag)

    @override
    @failures.in_phase("during teardown")
    def teardown(self) -> None:
        self._close_runtime()
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


def default_backend(device: torch.device) -> str:
    """``"cpu:gloo,cuda:nccl"`` on CUDA: NCCL moves activations and gradients, gloo the CPU tensors a step sends
    (a pure NCCL group raises on them); Lightning's default for any other device."""
    if device.type == "cuda":
        return "cpu:gloo,cuda:nccl"
    return pl_compat.default_process_group_backend_for_device(device)
