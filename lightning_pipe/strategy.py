"""``PipelineParallelStrategy``: Lightning's Trainer driving ``torch.distributed.pipelining``."""

from __future__ import annotations

import uuid
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_pipe import builder, failures, watchdog
from lightning_pipe.checkpoint import io as ckpt_io
from lightning_pipe.config import (
    PositiveInt,
    ScheduleName,
    check_microbatch_settings,
    check_pipeline_size,
    resolve_pipeline_size,
    resolve_schedule,
)
from lightning_pipe.errors import PipelineCheckpointError, PipelineConfigError, PipelineUsageError
from lightning_pipe.evaluation import check_eval_microbatches, eval_step
from lightning_pipe.grads import GradientStash, all_reduce_grads, clip_grad_norm_across
from lightning_pipe.metrics import bind_metrics

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_pipe.runtime import PipelineRuntime


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
        balance: Blocks per stage instead of ``split_points`` (e.g. ``[3, 5]``). Default: even split, the first
            stages taking one more when the blocks do not divide evenly.
        process_group_backend: ``torch.distributed`` backend. ``None``: ``nccl`` on CUDA, ``gloo`` on CPU.
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
        balance: Optional[list[PositiveInt]] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = watchdog.DEFAULT_TIMEOUT,
        init_weights: Optional[Union[str, Path]] = None,
        eval_microbatches: Union[Literal["auto"], PositiveInt] = "auto",
    ) -> None:
        super().__init__()
        # Validate what needs no world size now, so a bad config fails before processes start.
        check_pipeline_size(pipeline_size)
        resolve_schedule(schedule, stages_per_rank)
        check_microbatch_settings(microbatches, microbatch_size)
        check_eval_microbatches(eval_microbatches)
        if split_points is not None and balance is not None:
            raise PipelineConfigError("Set either `split_points` or `balance`, not both.")
        if frontend not in ("auto", "modules", "trace"):
            raise PipelineConfigError(f"`frontend={frontend!r}` is not one of 'auto', 'modules', 'trace'.")
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
        self._pp_group: Optional[dist.ProcessGroup] = None
        self._dp_group: Optional[dist.ProcessGroup] = None
        self._pp_ranks: list[int] = []
        self._runtime: Optional[PipelineRuntime] = None
        self._grads = GradientStash()
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
    def pipeline_rank(self) -> int:
        return self.global_rank % self.pipeline_size

    @property
    def data_parallel_rank(self) -> int:
        return self.global_rank // self.pipeline_size

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
        reset_seed()
        self._set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        pp, dp = resolve_pipeline_size(self._pipeline_size, self.world_size)
        self._pipeline_size, self._data_parallel_size = pp, dp
        self._schedule_name, self._stages_per_rank = resolve_schedule(self._schedule_name, self._stages_per_rank)
        self._pp_group, self._dp_group, self._pp_ranks = _new_groups(pp, dp, self.global_rank)

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
        # The network's attribute name is known only before the split (the trace frontend replaces the attribute).
        network_attr = builder.resolve_module(lightning_module, self._module_name)[0] if self._init_weights else ""
        self._runtime = builder.build_pipeline(
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
            group=self._pp_group,
            group_ranks=self._pp_ranks,
        )
        failures.describe(self.global_rank, [index for index, _ in self._runtime.stage_modules])
        bind_metrics(lightning_module, self._dp_group)
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._init_weights is not None:
            self._load_initial_weights(network_attr)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        # Lightning clips with the norm of this rank's gradients; the right norm spans every stage.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        if kwargs:
            raise PipelineUsageError(f"Unexpected keyword arguments for training_step: {sorted(kwargs)}.")
        batch, extra = args[0], tuple(args[1:])
        trainer = self.lightning_module.trainer
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        with self.precision_plugin.train_step_context(), self._grads.capture(params):
            result = self.runtime.train_step(batch, extra, trainer.accumulate_grad_batches)
        self.runtime.replay_logs(result)
        return torch.tensor(result.loss, device=self.root_device)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The schedule already ran backward in ``training_step``; here its gradients land after Lightning's
        ``zero_grad``, exactly where a single-device backward would put them."""
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        grads = self._grads.release()
        if self._data_parallel_size > 1:
            all_reduce_grads([g for _, g in grads], self._dp_group, self._data_parallel_size)
        self._grads.apply(grads)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

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
        return eval_step(self.runtime, hook, args[0], tuple(args[1:]), self._eval_microbatches)

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: Union[int, float]) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_across(params, float(clip_val), self._pp_group if self.pipeline_size > 1 else None)

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
        return ckpt_io.model_state(self.model)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's optimizer state, flattened and keyed by parameter name."""
        assert self.model is not None
        return ckpt_io.optimizer_state(self.model, getattr(optimizer, "_optimizer", optimizer))

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
        cls = type(self.lightning_module)
        ckpt_io.save(checkpoint, path, self._checkpoint_topology(), token, f"{cls.__module__}.{cls.__qualname__}")

    @override
    def load_checkpoint(self, checkpoint_path: Union[str, Path], weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a directory checkpoint into this rank's stages (model, and optimizers when fitting), or, outside
        ``fit``, the weights of a single-file ``.ckpt``; returns Lightning's remaining checkpoint state."""
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
            raise PipelineCheckpointError(
                f"`ckpt_path={str(checkpoint_path)!r}` is a single-file checkpoint; resuming `fit` from one would need"
                " its optimizer state, which a single file stores by position for one device's parameter order. To"
                f" train from its weights, pass `PipelineParallelStrategy(init_weights={str(checkpoint_path)!r})`; to"
                " resume a pipeline run, pass the checkpoint directory it saved."
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
            pipeline_group=self._pp_group,
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
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Union[Tensor, Any]:
        """Reduce across data-parallel replicas (every stage of a pipeline already holds the same logged value)."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group if group is not None else self._dp_group, reduce_op=reduce_op)
        return tensor

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = _sync_ddp_if_available(flag, None, reduce_op=ReduceOp.SUM)
        return bool(flag == self.world_size) if all else bool(flag)

    @override
    @failures.in_phase("during teardown")
    def teardown(self) -> None:
        if self._runtime is not None:
            self._runtime.interceptor.remove()
            self._runtime = None
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


# Groups by (pipeline size, data-parallel size, rank), kept for later Trainer entries in the same process group: every
# `fit`/`validate`/`test` would otherwise add a full set of gloo/NCCL groups (and their threads and sockets).
_GROUPS: dict[tuple[int, int, int], tuple[Any, Any, list[int]]] = {}


def _new_groups(pp: int, dp: int, rank: int) -> tuple[Any, Any, list[int]]:
    """Pipeline groups hold consecutive ranks; data-parallel groups hold the ranks of one stage position.

    Every process must create every group, in the same order, even those it is not a member of. All processes
    make the same cache decision: the cache is emptied together when the default process group is destroyed.
    """
    live = dist.distributed_c10d._world.pg_map
    cached = _GROUPS.get((pp, dp, rank))
    if cached is not None and all(g in live for g in cached[:2] if g is not None):
        return cached
    _GROUPS.clear()
    pp_group = dp_group = None
    pp_ranks: list[int] = []
    for replica in range(dp):
        ranks = list(range(replica * pp, (replica + 1) * pp))
        group = dist.new_group(ranks)
        if rank in ranks:
            pp_group, pp_ranks = group, ranks
    for position in range(pp):
        ranks = list(range(position, pp * dp, pp))
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_group = group
    _GROUPS[(pp, dp, rank)] = (pp_group, dp_group, pp_ranks)
    return pp_group, dp_group, pp_ranks
