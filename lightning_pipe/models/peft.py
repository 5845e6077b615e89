"""PEFT-wrapped transformers models as a model kind: a ``peft.PeftModel`` (``get_peft_model(model, LoraConfig(...))``)
around a transformers model with a pipeline plan.

peft renames what it wraps: the transformers model sits at ``base_model.model``, a tuned layer keeps its base weight
under ``base_layer`` (``q_proj.base_layer.weight``) beside its adapters (``q_proj.lora_A.default.weight``), and a
module of ``modules_to_save`` keeps the original under ``original_module`` beside its trainable copy
(``lm_head.modules_to_save.default.weight``). Everything else is the transformers kind's, through that prefix:

- the units are the transformers model's plan units under ``base_model.model.``; a stage holds its units' base
  layers and adapters, and the same stand-ins take the place of the others;
- a stage is entered and left inside the transformers model's forward while the PEFT model is called (its forward
  hooks, ``special_peft_forward_args``, run as on one device);
- on disk, a base weight is the transformers model's name (``base_layer`` and ``original_module`` left out) and a
  ``modules_to_save`` copy starts from the same stored tensor, as peft copies the pretrained module; adapters are not
  in a model directory, and keep peft's own initialisation (recorded in ``configure_model`` and replayed per rank).

- ``generate`` is the PEFT model's own (its forward hooks around the wrapped model's ``generate`` loop); each call
  that loop makes of the wrapped model is one call of the PEFT model through the stages, which keep their own
  layers' caches as a transformers model's do (:class:`PeftDecoding`).

Prompt-learning tuners (prefix, prompt, p-tuning) add virtual tokens to every layer's input and are refused, as is
tensor parallelism (peft's adapter layers are not in the model's tensor-parallel plan).

``peft`` is an optional dependency: nothing here imports it at module level.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from collections.abc import Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from lightning_pipe.errors import PipelineConfigError, PipelineModelError, PipelineUsageError
from lightning_pipe.models.base import Placeholder, WholeBackward
from lightning_pipe.models.huggingface.generation import HuggingFaceDecoding
from lightning_pipe.models.huggingface.kind import HuggingFaceKind
from lightning_pipe.models.huggingface.plan import is_hf_model
from lightning_pipe.models.huggingface.stage import prepare_call, run_stage
from lightning_pipe.models.units import Layout

#: where a ``PeftModel`` of a LoRA-style tuner (``BaseTuner``) holds the transformers model
PREFIX = "base_model.model"
#: the module names peft inserts into a wrapped module's path: a tuned layer's base, a saved module's original
_WRAPPED = ("base_layer", "original_module")
#: the copy of a ``modules_to_save`` module that trains: ``<module>.modules_to_save.<adapter name>``
_SAVED_COPY = re.compile(r"(^|\.)modules_to_save\.[^.]+(?=\.)")


def is_peft_model(network: nn.Module) -> bool:
    """Whether ``network`` is a ``peft.PeftModel`` (without importing peft)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(network, peft.PeftModel)


def inner_model(network: nn.Module) -> nn.Module:
    """The transformers model a PEFT model wraps (``network.base_model.model``); refuses tuners that hold it
    otherwise."""
    tuner = network.base_model
    model = getattr(tuner, "model", None)
    if not isinstance(getattr(tuner, "prefix", None), str) or model is None or not is_hf_model(model):
        peft_type = getattr(getattr(network, "active_peft_config", None), "peft_type", None)
        raise PipelineModelError(
            f"{type(network).__name__} wraps {type(tuner).__name__} (peft_type {peft_type}): lightning-pipe pipelines"
            " PEFT models whose tuner replaces layers of a transformers model (LoRA, LoHa, LoKr, IA3, ...)."
            " Prompt-learning tuners (prefix, prompt, p-tuning) add virtual tokens to every layer's input, which"
            " a stage cannot send on: use a LoRA-style tuner (`peft.LoraConfig`)."
        )
    return model


def adapter_prefixes(network: nn.Module) -> tuple[str, ...]:
    """The name prefixes of the tuner's adapter tensors (``lora_``, ``hada_``, ...)."""
    return (network.base_model.prefix,)


def base_name(name: str) -> str:
    """The name of a PEFT model's tensor in the transformers model it wraps (``name`` relative to the PEFT model):
    peft's prefix, ``base_layer``/``original_module`` and a ``modules_to_save`` copy's path left out."""
    relative = name[len(PREFIX) + 1 :] if name.startswith(PREFIX + ".") else name
    relative = _SAVED_COPY.sub("", relative)
    return ".".join(part for part in relative.split(".") if part not in _WRAPPED)


def _refuse_dora(network: nn.Module) -> None:
    configs = getattr(network, "peft_config", None) or {}
    dora = sorted(name for name, config in configs.items() if getattr(config, "use_dora", False))
    if dora:
        raise PipelineModelError(
            f"{type(network).__name__} has DoRA adapters ({dora}, `use_dora=True`), which lightning-pipe does not"
            " pipeline yet: peft computes a DoRA magnitude from the pretrained weight's norm in `get_peft_model`,"
            " before `init_weights` loads that weight. Use LoRA (`use_dora=False`) or another tuner (LoHa, LoKr)."
        )


def _config_record(config: Any) -> dict[str, Any]:
    """A peft config as JSON values (``to_dict``; its sets as sorted lists, as peft's ``save_pretrained`` writes)."""
    return json.loads(json.dumps(config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def _prefixed(names: Sequence[str]) -> tuple[str, ...]:
    return tuple(f"{PREFIX}.{name}" for name in names)


def peft_stage_call(
    view: nn.Module, args: tuple, kwargs: dict, received: tuple[Tensor, ...] | Tensor | None, first: bool, last: bool
) -> Any:
    """The transformers kind's stage call, entering and leaving the wrapped model's blocks while the PEFT model is
    called."""
    return run_stage(view, inner_model(view), args, kwargs, received, first, last)


def peft_profile_call(view: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The transformers kind's call as its stages make it (``use_cache=False``), for the wrapped model."""
    return (), prepare_call(view, args, kwargs, inner_model(view))


PEFT_WHOLE_BACKWARD = WholeBackward(peft_stage_call)
"""The stage call of a PEFT model around one whose stages run whole backward passes (Gemma 3n's AltUp)."""


class PeftKind:
    """A ``peft.PeftModel`` around a transformers model (:class:`~lightning_pipe.models.base.ModelKind`)."""

    stage_call = staticmethod(peft_stage_call)
    prepare_dataflow_call = None
    prepare_profile_call = staticmethod(peft_profile_call)

    def __init__(self, network: nn.Module) -> None:
        _refuse_dora(network)
        self.model = inner_model(network)
        self.inner = HuggingFaceKind(self.model)
        if isinstance(self.inner.stage_call, WholeBackward):
            self.stage_call = PEFT_WHOLE_BACKWARD
        self.name = f"peft {type(network).__name__} of transformers {type(self.model).__name__}"

    def layout(self, network: nn.Module, blocks: str = "auto") -> Layout:
        layout = self.inner.layout(inner_model(network), blocks)
        return Layout(
            pre=_prefixed(layout.pre),
            blocks=_prefixed(layout.blocks),
            post=_prefixed(layout.post),
            together=layout.together,
        )

    def dataflow_order(self, network: nn.Module) -> list[str] | None:
        raise PipelineModelError(
            f"{type(network).__name__} (a PEFT model) is pipelined by the default frontend only: pass"
            " `frontend='auto'` (or leave it out)."
        )

    def placeholder(self, network: nn.Module) -> Placeholder | None:
        inner = self.inner.placeholder(inner_model(network))
        if inner is None:
            return None
        cut = len(PREFIX) + 1
        return lambda unit: inner(unit[cut:])

    def tensor_parallel_plan(
        self, network: nn.Module, tensor_parallel: int, shared: Sequence[tuple[str, ...]] = ()
    ) -> dict[str, str] | None:
        raise PipelineConfigError(
            f"`tensor_parallel={tensor_parallel}` with a PEFT model ({type(network).__name__}): peft's adapter layers"
            " are not in the transformers model's tensor-parallel plan, so lightning-pipe cannot split them exactly."
            " Set `tensor_parallel=1` (pipeline and data parallelism only)."
        )

    def disk_names(self, network: nn.Module, name: str) -> Iterator[str]:
        """A base weight's names in the wrapped model's directory (:meth:`HuggingFaceKind.disk_names`); none for an
        adapter, which a model directory does not hold."""
        if self._is_adapter(network, name):
            return
        yield from self.inner.disk_names(inner_model(network), base_name(name))

    def ignored_on_load(self, network: nn.Module) -> tuple[list[str], list[str]]:
        missing, unexpected = self.inner.ignored_on_load(inner_model(network))
        adapters = [rf"(^|\.){re.escape(prefix)}" for prefix in adapter_prefixes(network)]
        # transformers' patterns are searched in the wrapped model's names: one anchored at its start moves under
        # peft's prefix
        moved = [rf"^{re.escape(PREFIX)}\.{p[1:]}" if p.startswith("^") else p for p in missing]
        return [*moved, *adapters], unexpected

    def new_weights(
        self, network: nn.Module, classes: Sequence[str], missing: Iterable[str], stored: Iterable[str]
    ) -> tuple[set[str], set[str]]:
        """The wrapped model's (:meth:`HuggingFaceKind.new_weights`: a causal LM's directory into a classifier), a
        new head's ``original_module`` and ``modules_to_save`` copy both new, as peft copies the initialised head."""
        missing = list(missing)
        ours, theirs = self.inner.new_weights(inner_model(network), classes, map(base_name, missing), stored)
        return {name for name in missing if base_name(name) in ours}, theirs

    def directory_type(self, network: nn.Module) -> str | None:
        return self.inner.directory_type(inner_model(network))

    def record(self, network: nn.Module, attribute: str) -> dict[str, Any] | None:
        """The wrapped model's record (its config, :meth:`HuggingFaceKind.record`) and the peft configs by adapter
        name, for ``export-hf --adapter``/``--merge`` (:mod:`lightning_pipe.models.peft_io`)."""
        record = self.inner.record(inner_model(network), attribute)
        if record is None:
            return None
        configs = {name: _config_record(config) for name, config in network.peft_config.items()}
        return {**record, "peft": {"prefix": PREFIX, "configs": configs}}

    def restore_buffers(self, module: nn.Module) -> bool:
        return self.inner.restore_buffers(module)

    def decoding(self) -> PeftDecoding:
        return PeftDecoding()

    def state_dict_adapter(self) -> Any:
        from lightning_pipe.models.huggingface.files import PeftFiles

        return PeftFiles()

    def _is_adapter(self, network: nn.Module, name: str) -> bool:
        return any(part.startswith(adapter_prefixes(network)) for part in name.split("."))


class PeftDecoding(HuggingFaceDecoding):
    """A PEFT model's ``generate`` under a pipeline: peft's own ``generate`` runs on every rank, and each call its
    wrapped model's loop makes of the wrapped model goes through the pipelined PEFT model instead (the stages run the
    PEFT model's forward, which hands the call, its cache included, to the wrapped model's)."""

    def check(self, network: nn.Module, args: tuple, kwargs: dict) -> None:
        super().check(network, args, kwargs)
        special = sorted(set(kwargs) & set(getattr(network, "special_peft_forward_args", ())))
        config = getattr(network, "active_peft_config", None)
        if getattr(config, "alora_invocation_tokens", None) is not None:
            special.append("alora_invocation_tokens (an aLoRA adapter)")
        if special:
            raise PipelineUsageError(
                f"`{type(network).__name__}.generate(...)` with {', '.join(special)}: peft applies these through"
                " forward hooks around the whole `generate`, which the pipeline's stages do not run. Generate without"
                " them (one active adapter: `model.set_adapter(name)`, and a LoRA without `alora_invocation_tokens`)."
            )

    def generate(self, network: nn.Module, args: tuple, kwargs: dict) -> Any:
        with _calls_through(network, inner_model(network)):
            return type(network).generate(network, *args, **kwargs)  # the class's: the instance's is the interceptor


@contextmanager
def _calls_through(network: nn.Module, model: nn.Module) -> Generator[None, None, None]:
    """Within the block, a call of ``model`` (the wrapped transformers model) from outside ``network``'s forward is
    a call of ``network``: the pipelined PEFT model, whose stages call ``model``'s forward themselves."""
    own = type(model).forward.__get__(model)
    busy = False

    def forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal busy
        if busy:  # a stage of this rank runs the PEFT model's forward, which calls the wrapped model's
            return own(*args, **kwargs)
        busy = True
        try:
            return network(*args, **kwargs)
        finally:
            busy = False

    forward.__signature__ = inspect.signature(own)  # type: ignore[attr-defined]  # generate reads its parameters
    before = model.__dict__.get("forward")
    model.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if before is None:
            model.__dict__.pop("forward", None)
        else:
            model.forward = before  # type: ignore[method-assign]
