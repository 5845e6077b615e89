"""``PipelineFabricStrategy``: a Lightning Fabric loop driving ``torch.distributed.pipelining``.

``Fabric(strategy="pipeline")`` after ``import lightning_pipe``. The same layers as the Trainer's strategy do the work:
the settings, the split, the step protocol (with the function front end, :class:`~lightning_pipe.step.frontend.
FunctionStep`), the wrappers and gradients; this class wires them to Fabric's calls. The one change to a Fabric loop:
the forward-and-loss part becomes a function, run by ``loss = model.step(fn, batch)`` (a pipelined step runs forward
and backward together); ``fabric.backward(loss)`` then hands the step's gradients over, scaled as ``loss`` was. See
docs/fabric.md.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_pipe.comm import collectives
from lightning_pipe.comm import mesh as meshes
from lightning_pipe.compat import lightning as pl_compat
from lightning_pipe.errors import PipelineConfigError, PipelineModelError, PipelineUsageError
from lightning_pipe.parallel import data_parallel as dp_modes
from lightning_pipe.parallel.grads import StageGradients, TieGroups, stage_gradients
from lightning_pipe.parallel.wrappers import Wrapped, unwrap_stages, wrap_stages
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
from lightning_pipe.split.builder import Split, split_module
from lightning_pipe.split.deferred_init import InitRecording, record_init
from lightning_pipe.step.engine import StepEngine
from lightning_pipe.step.frontend import FunctionStep
from lightning_pipe.step.rng import RngStreams

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: the attribute of the set-up module that runs a step (``model.step(fn, batch)`` on Fabric's wrapper finds it there)
STEP_ATTR = "step"
SETUP_ORDER = (
    "Set up the model first, then create the optimizer from the model's parameters: `model ="
    " fabric.setup_module(model)`, then `optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))`."
)

NOT_FROM_STEP = (
    "The tensor given to `fabric.backward` does not depend on the loss that `model.step(fn, batch)` returned. Pass"
    " that loss, or a tensor computed from it (e.g. `loss / accumulate`)."
)


@dataclass
class _PendingStep:
    """The loss of a step whose gradients wait for ``fabric.backward``."""

    loss: Tensor
    grad_scale: Optional[float]


class _NoBackwardSync:
    """``fabric.no_backward_sync(model, enabled)``: inside, FSDP stages keep their gradients unreduced (with
    ``"ddp"`` gradients are averaged once, at the clip or the optimizer step, anyway)."""

    def __init__(self, strategy: PipelineFabricStrategy) -> None:
        self.strategy = strategy

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager[Any]:
        engine = self.strategy.engine
        return engine.unsynchronized() if enabled else nullcontext()


class PipelineFabricStrategy(meshes.MeshAxes, DDPStrategy):
    """Pipeline parallelism for a Fabric loop: ``Fabric(strategy="pipeline")``.

    The arguments are those of :class:`~lightning_pipe.PipelineParallelStrategy` (docs/strategy.md), with the same
    defaults and ``"auto"`` values; ``tensor_parallel`` and ``loss_parallel`` need a ``configure_model`` hook, so
    they stay 1 and ``False`` here, and ``max_restarts`` and ``async_checkpoint`` belong to the Trainer's checkpoints.

    Arguments:
        pipeline_size: Processes per pipeline; the world size over it is the data-parallel size. ``"auto"``: all.
        schedule: A torch schedule by name (``1F1B``, ``Interleaved1F1B``, ``ZBVZeroBubble``, ...). ``"auto"``: as the
            Trainer's strategy.
        microbatches: Microbatches per batch given to ``model.step``. ``"auto"``: the number of stages.
        microbatch_size: Samples per microbatch instead of a count.
        stages_per_rank: Stages each process holds. ``"auto"``: as the Trainer's strategy.
        module: Attribute of the set-up module holding the network. ``"auto"``: its only child with parameters, else
            the module itself.
        frontend, blocks, split_points, balance: How the network is cut (docs/strategy.md).
        process_group_backend: ``torch.distributed`` backend. Default ``None``: ``gloo`` on CPU, ``nccl`` on CUDA.
        timeout: Timeout of collective and point-to-point operations. Default 10 minutes.
        init_weights: Weights to start from (a lightning-pipe checkpoint directory, a ``.ckpt``, a ``state_dict``
            file or a Hugging Face model directory), each rank reading only its stages' tensors.
        init_adapter: A PEFT adapter directory to start a ``get_peft_model`` network's adapters from, after
            ``init_weights`` (docs/pretrained.md).
        eval_microbatches: Microbatches per batch given to ``model.evaluate``. ``"auto"``: one per process.
        data_parallel: ``"ddp"`` (default) or ``"fsdp"``.
        inner_axis: The mesh axis of consecutive ranks: ``"dp"`` (default) or ``"pp"``.
        activation_checkpointing: Recompute blocks in backward: ``True`` every block, ``k`` every ``k``-th.
        compile: ``torch.compile`` each block in place: ``True`` or a dict of its options.
        model_plan: The pipeline plan of a transformers model whose family has none (docs/model-plan.md).
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
        compile: Union[bool, dict[str, Any]] = False,
        model_plan: Optional[ModelPlan] = None,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self._settings = PipelineSettings(
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
            eval_microbatches=eval_microbatches,
            data_parallel=data_parallel,
            inner_axis=inner_axis,
            activation_checkpointing=activation_checkpointing,
            compile=compile,
            model_plan=model_plan,
        )
        self._meshes = meshes.MeshCache()
        self._mesh: Optional[DeviceMesh] = None
        self._split: Optional[Split] = None
        self._owner: Optional[nn.Module] = None  # the set-up module (the split's network, or the module holding it)
        self._engine: Optional[StepEngine] = None
        self._gradients: Optional[StageGradients] = None
        self._wrapped = Wrapped()
        self._tie_groups = TieGroups()
        self._rng = RngStreams()
        self._init_recording: Optional[InitRecording] = None
        self._pending: Optional[_PendingStep] = None
        self._in_backward = False
        self._unsynchronized = False  # gradients handed over since the last synchronisation
        #: what setup installed on the user's objects, undone at teardown
        self._run = ExitStack()
        pl_compat.set_backward_sync_control(self, _NoBackwardSync(self))

    # ------------------------------------------------------------------ settings and topology
    @property
    def settings(self) -> PipelineSettings:
        """Every setting, validated; the ``"auto"`` values are resolved once the processes start."""
        return self._settings

    @property
    def data_parallel_size(self) -> int:
        return self._settings.data_parallel_size if self._settings.resolved else 1

    @property
    def engine(self) -> StepEngine:
        if self._engine is None:
            raise PipelineUsageError(
                "The pipeline is built in `fabric.setup_module(model)` (or `fabric.setup(model)`); it does not exist"
                " yet."
            )
        return self._engine

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Data is sharded over data-parallel replicas only: every stage of one pipeline must see the same batch.
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the process group, as Fabric's DDP strategy makes it
        settings = dataclasses.replace(self._settings, process_group_backend=self.process_group_backend)
        self._settings = settings.resolve(self.world_size)
        self._mesh = self._meshes.build(self._settings, self.root_device.type)

    # ------------------------------------------------------------------ the model
    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager[Any]:
        """``empty_init=True``: the model is built on the meta device and what its ``__init__`` does to its tensors
        is recorded; ``setup_module`` allocates and initialises only this rank's stages (replaying the record)."""
        if not empty_init:
            return super().module_init_context(empty_init)
        return self._meta_init()

    @contextmanager
    def _meta_init(self) -> Generator[None, None, None]:
        with self.precision.module_init_context(), torch.device("meta"), record_init() as recording:
            yield
        self._init_recording = recording

    @override
    def module_to_device(self, module: nn.Module) -> None:
        # Fabric moves the model before `setup_module`; only this rank's stages move, once they are cut.
        if self._split is not None:
            module.to(self.root_device)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Cut ``module`` down to this rank's stages (in place), allocate them, wrap them and plan their gradients;
        ``model.step(fn, batch)`` is added to it. Returns ``module`` itself."""
        if self._split is not None:
            raise PipelineUsageError(
                "Fabric(strategy='pipeline') pipelines one model per Fabric: `fabric.setup_module` was called a second"
                " time. Put every trained module inside one model (e.g. one `nn.Module` with both as children)."
            )
        if STEP_ATTR in dir(type(module)):
            raise PipelineModelError(
                f"{type(module).__name__} has its own `{STEP_ATTR}` attribute, which `model.step(fn, batch)` would"
                " hide under Fabric(strategy='pipeline'). Rename it in your model."
            )
        self._check_precision()
        recording, self._init_recording = self._init_recording, None
        self._owner = module
        self._split = split = split_module(
            module,
            self._settings,
            pipeline_rank=self.pipeline_rank,
            device=self.root_device,
            agree=lambda value: collectives.broadcast_object(value, 0, self._world, device=self.root_device),
            announce=rank_zero_info,
            recording=recording.finish(module) if recording is not None else None,
        )
        outside = (
            f"The pipelined network ({type(split.network).__name__}) was called outside `model.step(fn, batch)`. Under"
            " Fabric(strategy='pipeline') each rank holds only its stages: put the forward and the loss in a function"
            " of the batch and run it with `loss = model.step(fn, batch)` (training) or `model.evaluate(fn, batch)`."
        )
        self._engine = StepEngine(
            module, split, self._settings, self.pipeline_group, self.root_device, self._rng, self.device_mesh, outside
        )
        self._run.callback(self._close_engine)
        module.to(self.root_device)
        if self._settings.init_weights is not None or self._settings.init_adapter is not None:
            self._load_initial_weights(module, split)
        stages = self.engine.runtime.stages
        self._wrapped = wrap_stages(
            stages,
            split.block_names,
            checkpoint_every=self._settings.activation_checkpointing,
            compile_options=self._settings.compile,
            dp_mesh=self.device_mesh[DP] if self._settings.sharded else None,
            sharded_over=split.sharded_over,
        )
        split.sharded_over = self._wrapped.sharded_over
        self._run.callback(unwrap_stages, stages)
        ties = self._tie_groups.copies(self._mesh, self._meshes.layout, split, module)
        self._gradients = stage_gradients(module, ties, self.device_mesh, self._wrapped)
        # Every stage draws the same shuffling order: pipeline rank 0 decides.
        self._rng.agree(self.pipeline_group, self.engine.runtime.group_ranks[0])
        attributes = vars(module)
        attributes[STEP_ATTR] = self.step
        attributes["evaluate"] = self.evaluate
        self._run.callback(attributes.pop, STEP_ATTR, None)
        self._run.callback(attributes.pop, "evaluate", None)
        return module

    def _check_precision(self) -> None:
        from lightning.fabric.plugins.precision import MixedPrecision

        if isinstance(self.precision, MixedPrecision) and self.precision.scaler is not None:
            raise PipelineConfigError(
                f"`Fabric(precision={self.precision.precision!r})` needs a gradient scaler whose inf/NaN checks would"
                " have to agree across stages; Fabric(strategy='pipeline') does not support it. Use"
                " `precision='bf16-mixed'` (or '32-true', 'bf16-true')."
            )

    def _load_initial_weights(self, module: nn.Module, split: Split) -> None:
        from lightning_pipe.checkpoint import adapters
        from lightning_pipe.checkpoint import io as ckpt_io

        weights, adapter = self._settings.init_weights, self._settings.init_adapter
        if weights is not None:
            ckpt_io.load_weights(
                Path(weights),
                self.checkpoint_topology(),
                module,
                network_prefix=split.prefix,
                strict=True,
                precision=self.precision.precision,
            )
        if adapter is not None:
            adapters.load_adapters(Path(adapter), self.checkpoint_topology(), module, network_prefix=split.prefix)

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Any], scheduler: Any = None) -> Any:
        raise PipelineUsageError(
            "Fabric(strategy='pipeline') cuts the model into stages in `fabric.setup_module`, so an optimizer created"
            " before it holds parameters this rank no longer has (or meta tensors): `fabric.setup(model, optimizer)`"
            f" cannot be used. {SETUP_ORDER}"
        )

    @override
    def setup_optimizer(self, optimizer: Any) -> Any:
        if self._split is None:
            raise PipelineUsageError(
                f"An optimizer was set up before the model under Fabric(strategy='pipeline'). {SETUP_ORDER}"
            )
        own = {id(p) for p in self._split.network.parameters()}
        foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
        if foreign:
            raise PipelineUsageError(
                f"The optimizer holds {foreign} parameters that are not this rank's stages' (it was created before"
                f" `fabric.setup_module` cut the model). {SETUP_ORDER}"
            )
        return optimizer

    def _close_engine(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self._engine = None

    @property
    def _world(self) -> Any:
        return collectives.world_group()

    # ------------------------------------------------------------------ steps
    def step(self, fn: Callable[[Any], Any], batch: Any) -> Tensor:
        """One training step: ``fn(microbatch)`` (calls the model once, returns the loss or a dict with ``"loss"``
        and ``"num_items"``) runs per microbatch and the schedule runs forward and backward. Returns the batch's loss
        on every rank, as one device computes it; ``fabric.backward(loss)`` (or of any function of it) hands the
        gradients over."""
        if self._pending is not None:
            raise PipelineUsageError(
                "`model.step(fn, batch)` was called again before `fabric.backward(loss)` of the previous step. Under"
                " Fabric(strategy='pipeline') each step's backward has run already; `fabric.backward` adds its"
                " gradients (call it once per step, e.g. `fabric.backward(loss * 0)` to drop a step's gradients)."
            )
        assert self._gradients is not None
        user_step = FunctionStep(fn, context=self._outside_forward_context())
        with self.precision.forward_context(), self._gradients.capture(), pl_compat.inside_fabric_backward():
            outcome = self.engine.train(user_step, batch)
        window = None if self.engine.synchronized else "`fabric.no_backward_sync`"
        dp_modes.check_token_weighting(self._settings, outcome.grad_scale, self.data_parallel_group, window)
        loss = outcome.loss.detach().clone().requires_grad_(True)
        loss.register_hook(self._outside_backward)
        self._pending = _PendingStep(loss, outcome.grad_scale)
        return loss

    def evaluate(self, fn: Callable[[Any], Any], batch: Any) -> Any:
        """``fn(microbatch)`` (calls the model once) over the batch's microbatches in a forward-only pass; returns
        what ``fn`` returned, merged over the microbatches as the Trainer merges ``validation_step`` outputs (on
        every rank where it holds only scalars, else on the last stage's rank)."""
        context = self._outside_forward_context()
        user_step = FunctionStep(fn, name="the evaluation function", hook="validation_step", context=context)
        with torch.no_grad(), self.precision.forward_context():
            outcome = self.engine.evaluate(user_step, batch)
        if self._wrapped.sharded:
            dp_modes.reshard(self.engine.runtime.stages.values())
        return outcome.output

    def _outside_forward_context(self) -> Callable[[], AbstractContextManager[Any]]:
        """Where the step function runs: outside the precision's forward context (autocast, the default dtype of
        ``'bf16-true'``), as Fabric runs a loop's own code; the stages run inside it. The model's output reaches the
        function as Fabric's module wrapper converts it (to the default dtype outside the context)."""
        dtype, device_type = torch.get_default_dtype(), self.root_device.type

        @contextmanager
        def outside() -> Generator[None, None, None]:
            inside = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                with torch.autocast(device_type, enabled=False):
                    yield
            finally:
                torch.set_default_dtype(inside)

        return outside

    def _outside_backward(self, grad: Tensor) -> None:
        if not self._in_backward:
            raise PipelineUsageError(
                "`loss.backward()` was called on the loss of `model.step(fn, batch)`. Under Fabric(strategy='pipeline')"
                " the step ran its backward already; call `fabric.backward(loss)`, which hands its gradients over."
            )

    @override
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        """The pending step's gradients land in ``.grad``, multiplied by d ``tensor`` / d ``loss`` (``loss / 2`` for
        accumulation: halved), which is what back-propagating ``tensor`` on one device gives."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise PipelineUsageError(
                "`fabric.backward(loss)` under Fabric(strategy='pipeline') takes the loss that `model.step(fn, batch)`"
                " returned (or a tensor computed from it), once per step; no step is waiting for it. Run the forward"
                " and the loss through `loss = model.step(fn, batch)` first."
            )
        if not tensor.requires_grad:
            raise PipelineUsageError(NOT_FROM_STEP)
        self._in_backward = True
        try:
            super().backward(tensor, module, *args, **kwargs)
        finally:
            self._in_backward = False
        factor = pending.loss.grad
        if factor is None:
            raise PipelineUsageError(NOT_FROM_STEP)
        assert self._gradients is not None
        self._gradients.stash.scale = float(factor) * (pending.grad_scale if pending.grad_scale is not None else 1.0)
        self._gradients.stash.apply()
        self._unsynchronized = True

    def _synchronize(self) -> None:
        """Tied copies summed and replicas averaged, once for the gradients handed over since the last time: at the
        clip or the optimizer step, whichever comes first (as the Trainer's strategy does in ``optimizer_step``)."""
        if self._unsynchronized:
            assert self._gradients is not None
            self._gradients.sync.synchronize(self._gradients.parameters())
            self._unsynchronized = False

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Any,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the 2-norm of every stage's gradients; returns that norm (the same on every rank)."""
        if float(norm_type) != 2.0:
            raise PipelineConfigError(
                f"`fabric.clip_gradients(..., norm_type={norm_type})`: Fabric(strategy='pipeline') clips by the 2-norm"
                " over every stage only. Use `norm_type=2`."
            )
        self._synchronize()
        self.precision.unscale_gradients(optimizer)
        assert self._gradients is not None
        total = self._gradients.clip(optimizer, float(max_norm))
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order 2.0 for gradients from `parameters` is non-finite ({float(total)}), so it"
                " cannot be clipped. Set `error_if_nonfinite=False` to clip anyway."
            )
        return total

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Any, clip_val: Union[float, int]) -> None:
        self._synchronize()
        super().clip_gradients_value(module, optimizer, clip_val)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self._synchronize()
        return super().optimizer_step(optimizer, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_topology(self) -> Any:
        from lightning_pipe.checkpoint import io as ckpt_io
        from lightning_pipe.split import tied

        split = self._split
        aliases = tied.aliases(split.shared, split.prefix) if split is not None else {}
        return ckpt_io.Topology(
            global_rank=self.global_rank,
            world_size=self.world_size,
            pipeline_rank=self.pipeline_rank,
            pipeline_size=int(self._settings.pipeline_size),  # type: ignore[arg-type]
            data_parallel_rank=self.data_parallel_rank,
            data_parallel_size=self.data_parallel_size,
            stages_per_rank=int(self._settings.stages_per_rank),  # type: ignore[arg-type]
            schedule=self._settings.schedule,
            pipeline_group=self.pipeline_group,
            aliases=aliases,
            sharded=self._wrapped.sharded,
            tensor_parallel_rank=0,
            tensor_parallel_size=1,
            replica_group=self._meshes.replica_group,
            network_prefix=split.prefix if split is not None else "",
        )

    @override
    def save_checkpoint(
        self,
        path: Union[str, Path],
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """``fabric.save(path, state)``: the directory ``path`` of per-rank shards, the Trainer strategy's format
        (docs/checkpoints.md); every rank calls it."""
        from lightning_pipe.checkpoint import fabric_state
        from lightning_pipe.models import kind_of

        if storage_options is not None or filter:
            raise PipelineUsageError(
                "`fabric.save(..., filter=...)` and `storage_options` are not supported under"
                " Fabric(strategy='pipeline'): checkpoints are written with torch.distributed.checkpoint. Remove them."
            )
        split = self._require_split("fabric.save")
        path, token = self.broadcast((Path(path), uuid.uuid4().hex[:12]))
        record = kind_of(split.network).record(split.network, split.network_attr)  # for export-hf
        fabric_state.save_state(path, state, self._owner, self.checkpoint_topology(), token, record)

    @override
    def load_checkpoint(
        self,
        path: Union[str, Path],
        state: Optional[Union[nn.Module, Any, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """``fabric.load(path, state)``: each rank reads its own stages' entries (any layout at save time) into the
        model and optimizers of ``state``; returns the checkpoint's values ``state`` did not ask for."""
        from lightning_pipe.checkpoint import fabric_state

        self._require_split("fabric.load")
        if not isinstance(state, dict):
            state = {"model": state} if isinstance(state, nn.Module) else {}
        path = Path(self.broadcast(path))
        return fabric_state.load_state(path, state, self._owner, self.checkpoint_topology(), strict, weights_only)

    def _require_split(self, call: str) -> Split:
        if self._split is None or self._owner is None:
            raise PipelineUsageError(
                f"`{call}` under Fabric(strategy='pipeline') needs the set-up model (each rank saves and loads only its"
                " stages): call `fabric.setup_module(model)` first."
            )
        return self._split

    # ------------------------------------------------------------------ end
    @override
    def teardown(self) -> None:
        self._run.close()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Pipeline parallelism (torch.distributed.pipelining) for Fabric loops"
        )
