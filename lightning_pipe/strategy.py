"""``PipelineParallelStrategy``: Lightning's Trainer driving ``torch.distributed.pipelining``.

A thin adapter of the Trainer's hooks: the arguments and this process's pipeline (mesh, split, engine, wrappers,
gradients, initial weights, the exit stack undone at teardown) are :mod:`lightning_pipe.session`'s, shared with the
Fabric strategy; checkpoints are :mod:`lightning_pipe.checkpoint.hooks`', gradients landing and synchronising
:mod:`lightning_pipe.step.hooks`'. Nothing is left on the LightningModule but the split itself.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_pipe.checkpoint import hparams as ckpt_hparams
from lightning_pipe.checkpoint import optim as ckpt_optim
from lightning_pipe.checkpoint import resume as ckpt_resume
from lightning_pipe.checkpoint import snapshot as ckpt_snapshot
from lightning_pipe.checkpoint.hooks import CheckpointHooks
from lightning_pipe.comm import collectives
from lightning_pipe.compat import lightning as pl_compat
from lightning_pipe.errors import PipelineUsageError
from lightning_pipe.measure.memory import SavedBytesRecorder
from lightning_pipe.parallel import data_parallel as dp_modes
from lightning_pipe.parallel.grads import build_optimizers
from lightning_pipe.reliability import failures, recovery, restart, watchdog
from lightning_pipe.reliability.launcher import InPlace, PipelineLauncher
from lightning_pipe.scope import quieter_warnings, replaced
from lightning_pipe.session import PipelineArguments
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.split.builder import Split, has_network, is_split
from lightning_pipe.step.engine import StepEngine
from lightning_pipe.step.frontend import HookStep
from lightning_pipe.step.hooks import GradientHooks
from lightning_pipe.step.manual import ManualOptimization
from lightning_pipe.step.metrics import bind_metrics
from lightning_pipe.step.report import (
    announce_batch_arithmetic,
    announce_parameters,
    check_supported,
    check_training_batches,
    warn_batch_dependent,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl


class PipelineParallelStrategy(
    PipelineArguments, CheckpointHooks, GradientHooks, pl_compat.LauncherHook, ParallelStrategy
):
    """Pipeline parallelism for an unchanged LightningModule: ``Trainer(strategy="pipeline")``.

    The network is cut into stages; each process builds and keeps only its own stages (parameter names stay those of
    the full model), and every training step runs as one ``torch.distributed.pipelining`` schedule step. Processes
    beyond one pipeline form data-parallel replicas of it. The arguments are :class:`~lightning_pipe.session.
    PipelineArguments`' (docs/strategy.md). Checkpoints are directories of per-rank ``torch.distributed.checkpoint``
    shards under the full model's names: they load into any layout, and ``python -m lightning_pipe.checkpoint
    consolidate`` makes an ordinary ``.ckpt``.
    """

    strategy_name = "pipeline"
    not_built = "The pipeline is built in `Trainer.fit/validate/...` setup; it does not exist yet."

    def init_front_end(self, settings: PipelineSettings) -> None:
        ParallelStrategy.__init__(self)
        #: a manual-optimization module's optimizer calls (None under automatic optimization)
        self._manual: Optional[ManualOptimization] = None
        self._saved: dict[int, SavedBytesRecorder] = {}
        self._memory_logged = False
        self.num_nodes = 1
        #: this rank's in-memory snapshots and its buddy's (``snapshot_every``); they outlive Trainer entries
        interval = settings.snapshot_interval
        self._snapshots = ckpt_snapshot.Snapshots(interval) if interval else None
        # A rank started by a launcher ends when its launcher does, from now on (docs/reliability.md).
        watchdog.start_if_launched()
        collectives.destroy_at_exit()  # registered before the launch's: rank 0 joins its ranks, then destroys

    # ------------------------------------------------------------------ environment
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
        snapshots = self._snapshots
        in_place = None
        if snapshots is not None:
            in_place = InPlace(lambda: snapshots.any, ckpt_snapshot.MEMORY, self._release_groups)
        return PipelineLauncher(
            environment, self.num_processes, self.num_nodes, settings.timeout, restarts, find, in_place, settings.spares
        )

    def _release_groups(self) -> None:
        """Recovery in place: drop every reference of the strategy's to the broken run's process groups."""
        self._session.release_groups()
        if self._snapshots is not None:
            self._snapshots.release_group()

    @override
    @failures.in_phase("during start-up")
    def setup_environment(self) -> None:
        super().setup_environment()
        # No `reset_seed()` as Lightning's DDP does: every process runs the user's script, seeded as on one device, and
        # re-seeding here would give a shuffling DataLoader another order than that device (see RngStreams).
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        backend = self._settings.process_group_backend or collectives.default_backend(self.root_device)
        kwargs: dict[str, Any] = {"timeout": self._settings.timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        if (store := restart.attempt_store(self._settings.timeout)) is not None:
            kwargs["store"] = store  # a restarted torchrun worker: this attempt's keys only
        pl_compat.init_dist_connection(self.cluster_environment, backend, **kwargs)
        mesh = self._session.start(backend, self.global_rank, self.world_size, self.root_device.type)
        if (module := self.lightning_module) is not None:
            self._session.run.callback(pl_compat.set_device_mesh, module, module.device_mesh)
            pl_compat.set_device_mesh(module, mesh)

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
        with self._session.meta_init(self.root_device):
            yield
        self._session.finish_recording(self.lightning_module)

    # ------------------------------------------------------------------ setup
    @override
    @failures.in_phase("during start-up")
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module, session = self.lightning_module, self._session
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING

        def place() -> None:
            session.run.callback(bind_metrics(module, self.data_parallel_group))
            session.run.enter_context(collectives.picklable_groups())  # the metrics' group pickles and deep-copies
            if fitting and not self._saved:
                self._saved = {s: SavedBytesRecorder(m) for s, m in self.runtime.stages.items()}
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()

        split = self._split_network(module)
        precision = self.precision_plugin.precision
        session.build(
            module, split, device=self.root_device, place=place, precision=precision, strict=module.strict_loading
        )
        self.barrier()
        if fitting:
            build_optimizers(split.network, module, lambda: self.setup_optimizers(trainer), lambda: self.optimizers)
        self.setup_precision_plugin()
        if fitting:
            pl_compat.optimizers_to_device(self.optimizers, self.root_device)
        # Lightning clips with the norm of this rank's gradients; the right norm spans every stage. Scoped to this
        # entry: the plugin may be the user's object, reused by another Trainer.
        assert session.gradients is not None
        session.run.enter_context(replaced(self.precision_plugin, "clip_grad_by_norm", session.gradients.clip))
        session.run.enter_context(quieter_warnings(self.global_rank, replicated=self.data_parallel_size > 1))
        session.agree_random_streams()
        resumed_from = self.launcher.resumed_from if fitting and isinstance(self.launcher, PipelineLauncher) else None
        self.open_checkpoints(trainer, session.rng, self._settings.async_checkpoint, resumed_from)
        if fitting and self._snapshots is not None:
            self._start_snapshots(trainer)
        announce_parameters(trainer, module, self.pipeline_group, split)

    def _start_snapshots(self, trainer: pl.Trainer) -> None:
        """``snapshot_every``: in a recovery, agree on the snapshot to resume from (collective); then take them."""
        assert self._snapshots is not None and self._checkpoints is not None
        if self._settings.snapshot_every == "auto" and not recovery.enabled():
            return  # "auto": only where this package's supervisor recovers in place
        # The buddies are the same stage in another replica where there is one (reliability.recovery.buddies).
        self._snapshots.replicas = self._session.meshes.layout.stage_positions()
        launcher = self.launcher
        if isinstance(launcher, PipelineLauncher) and launcher.recovering:
            launcher.recovering = False
            step = self._snapshots.agree(self.num_processes)
            self.barrier()
            recovery.joined()
            if self.global_rank == 0:
                recovery.mark_recovered(recovery.generation())
                rank_zero_info(f"lightning-pipe: recovered in place: resuming `fit` from the snapshot of step {step}.")
        self._snapshots.use_group()  # collective: the exchanges' gloo group, made here on every rank
        callback = ckpt_snapshot.SnapshotCallback(self._snapshots, self._checkpoints.continuation, self.num_processes)
        trainer.callbacks.append(callback)
        self._session.run.callback(trainer.callbacks.remove, callback)

    def _split_network(self, module: Any) -> Split:
        """This rank's stages: cut now or found from an earlier cut (:meth:`PipelineSession.cut`)."""
        check_supported(module, self.precision_plugin)
        # Single-device checkpoints number parameters in the full model's optimizer order, and hold the networks kept
        # by `save_hyperparameters()` whole: record both before the split.
        if not is_split(module):
            ckpt_hparams.record(module)
            if module.trainer.state.fn == TrainerFn.FITTING:
                ckpt_optim.record_param_groups(module)
        launcher = self.launcher
        rejoin = isinstance(launcher, PipelineLauncher) and launcher.recovering
        return self._session.cut(module, self.root_device, rank_zero_info, rejoin)

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
        announce_batch_arithmetic(trainer, self.data_parallel_size, self.world_size)
        assert self._session.split is not None
        warn_batch_dependent(trainer, self._settings, self._session.split, self.pipeline_group)

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        engine, gradients = self._require_engine("training_step", kwargs), self._session.gradients
        module = self.lightning_module
        assert gradients is not None
        # Manual optimization: the step's optimizer calls are recorded while the schedule runs, and done after it.
        self._manual = manual = ManualOptimization.of(module, self._manual, gradients.synchronize)
        step = manual.user_step(args[1:]) if manual else HookStep(module, "training_step", tuple(args[1:]))
        accumulate = module.trainer.accumulate_grad_batches
        released = [] if manual else pl_compat.gradients_zeroed_after_step(module.trainer)
        with self.precision_plugin.train_step_context(), gradients.capture(released):
            with manual.recorded() if manual else nullcontext():
                outcome = engine.train(step, args[0], accumulate)
        window = f"`accumulate_grad_batches={accumulate}`" if accumulate > 1 else None
        dp_modes.check_token_weighting(
            self._settings, outcome.grad_scale, window=window, group_of=lambda: self.data_parallel_group
        )
        gradients.stash.scale = outcome.grad_scale
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
        return self.engine

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
        if self._session.wrapped.sharded:
            dp_modes.reshard(engine.runtime.stages.values())
        if hook == "predict_step":
            return engine.runtime.to_first_rank(outcome.output)
        return outcome.output if engine.runtime.has_last or outcome.output_shared else None

    def checkpoint_network(self) -> tuple[str, Optional[torch.nn.Module]]:
        split = self._session.split
        return (split.network_attr, split.network) if split is not None else ("", None)

    # ------------------------------------------------------------------ collectives
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
    @failures.in_phase("during teardown")
    def teardown(self) -> None:
        failed = self._checkpoints is not None and self._checkpoints.failed
        self.close_checkpoints()  # pending saves complete (or are dropped after a failure)
        if self._snapshots is not None and failed:
            self._snapshots.abandon()  # a peer may be lost: its exchange in the background is not waited for
        elif self._snapshots is not None:
            self._snapshots.wait()  # the snapshot in the background completes, or its error is raised
        # Undo what this entry installed on the user's objects (interceptor, metric groups, clipping, wrappers).
        self._session.close()
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
