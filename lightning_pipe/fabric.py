"""``PipelineFabricStrategy``: a Lightning Fabric loop driving ``torch.distributed.pipelining``.

``Fabric(strategy="pipeline")`` after ``import lightning_pipe``. A thin adapter of Fabric's calls: the arguments and
this process's pipeline are :mod:`lightning_pipe.session`'s, shared with the Trainer's strategy; the steps are
:mod:`lightning_pipe.step.fabric_steps`'. The one change to a Fabric loop: the forward-and-loss part becomes a function,
run by ``loss = model.step(fn, batch)`` (a pipelined step runs forward and backward together); ``fabric.backward(loss)``
then hands the step's gradients over, scaled as ``loss`` was. See docs/fabric.md.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_pipe.compat import lightning as pl_compat
from lightning_pipe.errors import PipelineConfigError, PipelineModelError, PipelineUsageError
from lightning_pipe.session import PipelineArguments
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.split.builder import Split
from lightning_pipe.step.fabric_steps import FabricSteps

#: the attribute of the set-up module that runs a step (``model.step(fn, batch)`` on Fabric's wrapper finds it there)
STEP_ATTR = "step"
SETUP_ORDER = (
    "Set up the model first, then create the optimizer from the model's parameters: `model ="
    " fabric.setup_module(model)`, then `optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))`."
)
#: the arguments only the Trainer's strategy uses, and why
TRAINER_ONLY = {
    "tensor_parallel": "tensor parallelism is applied in a LightningModule's `configure_model`",
    "loss_parallel": "it goes with `tensor_parallel`",
    "max_restarts": "restarts are Lightning's launcher's (torchrun: `--max-restarts`)",
    "async_checkpoint": "it belongs to the Trainer's checkpoints",
    "snapshot_every": "recovery in place restarts the Trainer's `fit`",
    "spares": "they replace ranks in a recovery in place",
}


class _NoBackwardSync:
    """``fabric.no_backward_sync(model, enabled)``: inside, FSDP stages keep their gradients unreduced (with
    ``"ddp"`` gradients are averaged once, at the clip or the optimizer step, anyway)."""

    def __init__(self, strategy: PipelineFabricStrategy) -> None:
        self.strategy = strategy

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager[Any]:
        engine = self.strategy.engine
        return engine.unsynchronized() if enabled else nullcontext()


class PipelineFabricStrategy(PipelineArguments, DDPStrategy):
    """Pipeline parallelism for a Fabric loop: ``Fabric(strategy="pipeline")``.

    The arguments are :class:`~lightning_pipe.session.PipelineArguments`' (docs/strategy.md), with the same defaults
    and ``"auto"`` values; ``tensor_parallel``, ``loss_parallel``, ``max_restarts`` and ``async_checkpoint`` are the
    Trainer's only (:data:`TRAINER_ONLY`): another value than the default is refused.
    """

    strategy_name = "pipeline"
    not_built = (
        "The pipeline is built in `fabric.setup_module(model)` (or `fabric.setup(model)`); it does not exist yet."
    )

    def init_front_end(self, settings: PipelineSettings) -> None:
        defaults = PipelineSettings()
        for name, why in TRAINER_ONLY.items():
            value = getattr(settings, name)
            if value != getattr(defaults, name) and not (name == "tensor_parallel" and value == 1):
                raise PipelineConfigError(
                    f"`{name}={value!r}` is not supported by Fabric(strategy='pipeline'): {why}. Leave `{name}` at its"
                    f" default ({getattr(defaults, name)!r}), or train with the Trainer's `strategy='pipeline'`."
                )
        DDPStrategy.__init__(self, process_group_backend=settings.process_group_backend, timeout=settings.timeout)
        self._owner: Optional[nn.Module] = None  # the set-up module (the split's network, or the module holding it)
        self._steps: Optional[FabricSteps] = None
        pl_compat.set_backward_sync_control(self, _NoBackwardSync(self))

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the process group, as Fabric's DDP strategy makes it
        backend = self.process_group_backend
        assert backend is not None
        self._session.start(backend, self.global_rank, self.world_size, self.root_device.type)

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
        with self.precision.module_init_context(), self._session.meta_init(self.root_device):
            yield

    @override
    def module_to_device(self, module: nn.Module) -> None:
        # Fabric moves the model before `setup_module`; only this rank's stages move, once they are cut.
        if self._session.split is not None:
            module.to(self.root_device)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Cut ``module`` down to this rank's stages (in place), allocate them, wrap them and plan their gradients;
        ``model.step(fn, batch)`` is added to it. Returns ``module`` itself."""
        if self._session.split is not None:
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
        session, device = self._session, self.root_device
        self._owner = module
        session.finish_recording(module)
        split = session.cut(module, device, rank_zero_info)
        outside = (
            f"The pipelined network ({type(split.network).__name__}) was called outside `model.step(fn, batch)`. Under"
            " Fabric(strategy='pipeline') each rank holds only its stages: put the forward and the loss in a function"
            " of the batch and run it with `loss = model.step(fn, batch)` (training) or `model.evaluate(fn, batch)`."
        )
        precision = self.precision.precision
        strict = bool(getattr(module, "strict_loading", True))  # a LightningModule's own rule, as the Trainer's
        session.build(
            module,
            split,
            device=device,
            place=lambda: module.to(device),
            precision=precision,
            strict=strict,
            outside=outside,
        )
        session.agree_random_streams()
        self._steps = steps = FabricSteps(session, lambda: self.engine, self.precision, device)
        attributes = vars(module)
        attributes[STEP_ATTR], attributes["evaluate"] = steps.step, steps.evaluate
        session.run.callback(attributes.pop, STEP_ATTR, None)
        session.run.callback(attributes.pop, "evaluate", None)
        return module

    def _check_precision(self) -> None:
        from lightning.fabric.plugins.precision import MixedPrecision

        if isinstance(self.precision, MixedPrecision) and self.precision.scaler is not None:
            raise PipelineConfigError(
                f"`Fabric(precision={self.precision.precision!r})` needs a gradient scaler whose inf/NaN checks would"
                " have to agree across stages; Fabric(strategy='pipeline') does not support it. Use"
                " `precision='bf16-mixed'` (or '32-true', 'bf16-true')."
            )

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Any], scheduler: Any = None) -> Any:
        raise PipelineUsageError(
            "Fabric(strategy='pipeline') cuts the model into stages in `fabric.setup_module`, so an optimizer created"
            " before it holds parameters this rank no longer has (or meta tensors): `fabric.setup(model, optimizer)`"
            f" cannot be used. {SETUP_ORDER}"
        )

    @override
    def setup_optimizer(self, optimizer: Any) -> Any:
        if self._session.split is None:
            raise PipelineUsageError(
                f"An optimizer was set up before the model under Fabric(strategy='pipeline'). {SETUP_ORDER}"
            )
        own = {id(p) for p in self._session.split.network.parameters()}
        foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
        if foreign:
            raise PipelineUsageError(
                f"The optimizer holds {foreign} parameters that are not this rank's stages' (it was created before"
                f" `fabric.setup_module` cut the model). {SETUP_ORDER}"
            )
        return optimizer

    # ------------------------------------------------------------------ steps
    @override
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        """The pending step's gradients land in ``.grad``, scaled by d ``tensor`` / d ``loss`` (``FabricSteps``)."""
        fabric_backward = super().backward
        self._require_steps().backward(tensor, lambda: fabric_backward(tensor, module, *args, **kwargs))

    def _synchronize(self) -> None:
        if self._steps is not None:
            self._steps.synchronize()

    def _require_steps(self) -> FabricSteps:
        if self._steps is None:
            raise PipelineUsageError(self.not_built)
        return self._steps

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
        assert self._session.gradients is not None
        total = self._session.gradients.clip(optimizer, float(max_norm))
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
        model and optimizers of ``state``; returns the checkpoint's values ``state`` did not ask for. ``fabric.load_raw(
        file, model)``: the file's whole state dict, through ``model.load_state_dict`` (each rank keeps its own)."""
        from lightning_pipe.checkpoint import fabric_state
        from lightning_pipe.models.files import load_mapped

        self._require_split("fabric.load")
        if isinstance(state, nn.Module) and Path(path).is_file():
            # `fabric.load_raw(path, model)`: a whole model's state dict, each rank keeping its stages' entries.
            state.load_state_dict(load_mapped(Path(path), weights_only), strict=strict)
            return {}
        if not isinstance(state, dict):
            state = {"model": state} if isinstance(state, nn.Module) else {}
        path = Path(self.broadcast(path))
        return fabric_state.load_state(path, state, self._owner, self.checkpoint_topology(), strict, weights_only)

    def _require_split(self, call: str) -> Split:
        if self._session.split is None or self._owner is None:
            raise PipelineUsageError(
                f"`{call}` under Fabric(strategy='pipeline') needs the set-up model (each rank saves and loads only its"
                " stages): call `fabric.setup_module(model)` first."
            )
        return self._session.split

    # ------------------------------------------------------------------ end
    @override
    def teardown(self) -> None:
        self._session.close()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Pipeline parallelism (torch.distributed.pipelining) for Fabric loops"
        )
