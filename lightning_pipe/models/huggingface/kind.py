"""transformers models as a model kind: what the strategy knows about them, behind :class:`~lightning_pipe.models.base.
ModelKind`.

Units from the model's pipeline plan (:mod:`.plan`), stages entered and left inside the model's own forward
(:mod:`.stage`), the model's tensor-parallel plan (:mod:`.tensor_parallel`), the names of a ``save_pretrained``
directory (the base model's prefix added or removed, as ``from_pretrained`` does), and the config a checkpoint records
for ``export-hf``.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch import nn

from lightning_pipe.compat import transformers as hf_compat
from lightning_pipe.errors import PipelineUsageError
from lightning_pipe.models.base import Placeholder, WholeBackward
from lightning_pipe.models.huggingface import altup, router_logits
from lightning_pipe.models.huggingface.generation import HuggingFaceDecoding
from lightning_pipe.models.huggingface.heads import new_weights
from lightning_pipe.models.huggingface.plan import (
    base_prefix,
    hf_layout,
    hf_placeholder,
    is_hf_model,
    plan_order,
    restore_rotary_buffers,
)
from lightning_pipe.models.huggingface.stage import hf_stage_call, prepare_call
from lightning_pipe.models.huggingface.tensor_parallel import hf_tensor_parallel_plan
from lightning_pipe.models.huggingface.vision import OLDER_NAMES, tower_names
from lightning_pipe.models.units import Layout


def prepare_dataflow_call(view: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A transformers model's call on the dataflow frontend: by name, ``use_cache=False``, and no outputs that its
    hooks collect from every layer (each stage runs only its own layers)."""
    call = prepare_call(view, args, kwargs)
    if router_logits.requested(view, call):
        raise PipelineUsageError(
            f"{type(view).__name__} was called with `output_router_logits=True` on `frontend='dataflow'`, where each"
            " stage records only its own layers' router logits. Pass `output_router_logits=False`, or pipeline this"
            " model with the default frontend, which carries them to the last stage."
        )
    return (), call


def prepare_profile_call(view: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A transformers model's call as its stages make it (by name, ``use_cache=False``): a unit measured alone and
    called again then sees the same inputs (a cache from the user's call would grow by one microbatch per call)."""
    return (), prepare_call(view, args, kwargs)


def _has_submodule(network: nn.Module, name: str) -> bool:
    try:
        network.get_submodule(name)
    except AttributeError:
        return False
    return True


WHOLE_BACKWARD = WholeBackward(hf_stage_call)
"""The stage call of a model with AltUp (Gemma 3n): one object, so that every ``kind_of`` gives the same call."""


class HuggingFaceKind:
    """A transformers ``PreTrainedModel`` (:class:`~lightning_pipe.models.base.ModelKind`)."""

    stage_call = staticmethod(hf_stage_call)
    prepare_dataflow_call = staticmethod(prepare_dataflow_call)
    prepare_profile_call = staticmethod(prepare_profile_call)

    def __init__(self, network: nn.Module) -> None:
        self.name = f"transformers {type(network).__name__}"
        if altup.needs_whole_backward(network):
            self.stage_call = WHOLE_BACKWARD

    def layout(self, network: nn.Module, blocks: str = "auto") -> Layout:
        return hf_layout(network)  # the model's own pipeline plan names its blocks

    def dataflow_order(self, network: nn.Module) -> list[str] | None:
        """The pipeline plan in execution order: the model's own, or (an encoder-decoder whose plans are on its
        encoder's and decoder's configs, T5Gemma in transformers 5) its sub-models' in definition order, then its
        heads; ``None`` without any."""
        if getattr(network.config, "base_model_pp_plan", None):
            return plan_order(network)
        parts: list[tuple[str, nn.Module]] = []
        for name, sub in network.named_modules():
            inside = any(name.startswith(f"{outer}.") for outer, _ in parts)
            if name and not inside and is_hf_model(sub) and getattr(sub.config, "base_model_pp_plan", None):
                parts.append((name, sub))
        if not parts:
            return None
        # The task model's own entries (its heads); in transformers 5 its instance plan also lists the sub-models'.
        heads = [
            name
            for name in hf_compat.head_pp_plan(network)
            if _has_submodule(network, name) and not any(name.startswith(f"{part}.") for part, _ in parts)
        ]
        return [f"{name}.{entry}" for name, sub in parts for entry in plan_order(sub)] + heads

    def placeholder(self, network: nn.Module) -> Placeholder | None:
        return hf_placeholder(network)

    def tensor_parallel_plan(
        self, network: nn.Module, tensor_parallel: int, shared: Sequence[tuple[str, ...]] = ()
    ) -> dict[str, str] | None:
        return hf_tensor_parallel_plan(network, tensor_parallel, list(shared))

    def disk_names(self, network: nn.Module, name: str) -> Iterator[str]:
        """``name``, then with the base model's prefix removed or added: a base model's directory loads into its task
        model and the other way round, as with ``from_pretrained``; then under the class's older names (a Llava
        directory that transformers wrote, 4.x or 5.x: :data:`.vision.OLDER_NAMES`), the vision tower's weights also
        as the other major version names them (:func:`.vision.tower_names`)."""
        yield name
        base = base_prefix(network)
        if base:
            yield name[len(base) + 1 :] if name.startswith(base + ".") else f"{base}.{name}"
        older = {f"^{k}": v for k, v in OLDER_NAMES.get(type(network).__name__, {}).items()}
        for variant in tower_names(network, name):
            if variant != name:
                yield variant
            for stored, ours in {**older, **hf_compat.legacy_names(network)}.items():
                # only plain prefixes (`^language_model.model`) can be turned back into the stored name
                plain = stored.removeprefix("^")
                if stored.startswith("^") and re.fullmatch(r"[\w.]+", plain) and variant.startswith(ours + "."):
                    yield plain + variant[len(ours) :]

    def ignored_on_load(self, network: nn.Module) -> tuple[list[str], list[str]]:
        return hf_compat.keys_to_ignore(network)

    def new_weights(
        self, network: nn.Module, classes: Sequence[str], missing: Iterable[str], stored: Iterable[str]
    ) -> tuple[set[str], set[str]]:
        """A task head new to a directory of another class (a causal LM's into a classifier), and that class's own
        head, as ``from_pretrained`` treats them (:func:`.heads.new_weights`)."""
        return new_weights(network, base_prefix(network), classes, missing, stored)

    def directory_type(self, network: nn.Module) -> str | None:
        model_type = getattr(getattr(network, "config", None), "model_type", None)
        return model_type if isinstance(model_type, str) else None

    def record(self, network: nn.Module, attribute: str) -> dict[str, Any] | None:
        """What ``export-hf`` needs: the network's class, its config and generation config as ``save_pretrained``
        writes them, and the LightningModule's attribute holding it."""
        config = getattr(network, "config", None)
        can_generate = getattr(network, "can_generate", None)
        if not callable(getattr(config, "to_json_string", None)) or not callable(can_generate):
            return None
        config = copy.deepcopy(config)
        config.architectures = [type(network).__name__]  # as save_pretrained does
        generation = getattr(network, "generation_config", None) if network.can_generate() else None
        return {
            "attribute": attribute,
            "class": type(network).__name__,
            "config": json.loads(config.to_json_string(use_diff=True)),
            "generation_config": None if generation is None else json.loads(generation.to_json_string(use_diff=True)),
        }

    @staticmethod
    def restore_buffers(module: nn.Module) -> bool:
        """A transformers rotary embedding's ``inv_freq`` (inside any network: also the submodule hook of
        :func:`lightning_pipe.models.restore_buffers`)."""
        return restore_rotary_buffers(module)

    def decoding(self) -> HuggingFaceDecoding:
        return HuggingFaceDecoding()

    def state_dict_adapter(self) -> Any:
        from lightning_pipe.models.huggingface.files import HuggingFaceFiles

        return HuggingFaceFiles()
