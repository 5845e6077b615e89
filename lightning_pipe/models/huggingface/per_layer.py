"""Per-layer inputs (Gemma 4's text model): every decoder layer reads its own slice of a tensor computed once, before
the layers, from the token ids and the token embeddings.

transformers' Gemma 4 computes ``per_layer_inputs`` (batch x tokens x layers x a small width) in its base model's
``project_per_layer_inputs``, from the ``embed_tokens_per_layer`` table looked up by ``input_ids``
(``get_per_layer_inputs``) and a projection of the token embeddings (``per_layer_model_projection``, normed by
``per_layer_projection_norm``), and hands block ``i`` the slice ``per_layer_inputs[:, :, i]``. Under the pipeline:

- the three modules are units before the blocks (:data:`MODULES`), so the first stage holds them with the token
  embedding: a later stage has neither the token embeddings the projection reads nor the table;
- the first stage computes ``per_layer_inputs`` as on one device and sends, with the hidden states, the slices of
  the layers after its own; each later stage takes the slices of its own layers and sends on the rest. The values
  every block reads, and their gradients (which travel back like the hidden states'), are one device's.

Another choice, each stage holding its layers' columns of the table and computing its slices from ``input_ids``,
sends nothing for the table but still needs the token embeddings' projection on every stage (the token embeddings
sent, or their table held, by every stage), and splits a parameter across stages, which checkpoints do not do:
docs/huggingface.md measures both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.errors import PipelineModelError

MODULES = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")
"""The base model's modules that compute the per-layer inputs, in the order the forward calls them."""


def has_per_layer_inputs(base: nn.Module) -> bool:
    """Whether the base model gives each block its own slice of per-layer inputs (Gemma 4's text model with
    ``hidden_size_per_layer_input`` set)."""
    return bool(getattr(getattr(base, "config", None), "hidden_size_per_layer_input", 0)) and all(
        callable(getattr(base, method, None)) for method in ("get_per_layer_inputs", "project_per_layer_inputs")
    )


def plan_entries(base: nn.Module) -> list[str]:
    """The per-layer modules of ``base`` (names relative to it) to put into its pipeline plan before the blocks."""
    if not has_per_layer_inputs(base):
        return []
    return [name for name in MODULES if isinstance(getattr(base, name, None), nn.Module)]


class PerLayerInputs:
    """The per-layer inputs of one stage call: on the first stage computed by the model and recorded, on a later one
    taken from what the previous stage sent (``received``: the slices from this stage's first block on)."""

    def __init__(self, base: nn.Module | None, first: int, received: Tensor | None) -> None:
        self.base, self.first, self.received = base, first, received
        self.computed: Tensor | None = None

    @property
    def active(self) -> bool:
        return self.base is not None

    @contextmanager
    def installed(self) -> Iterator[None]:
        """While the forward runs, the base model's per-layer methods record (first stage) or return (later
        stages) the per-layer inputs: set on the instance for the call only."""
        if self.base is None:
            yield
            return
        base, cls = self.base, type(self.base)
        with ExitStack() as stack:
            for method in ("get_per_layer_inputs", "project_per_layer_inputs"):
                stack.callback(base.__dict__.pop, method, None)
            if self.received is None:
                original = cls.project_per_layer_inputs

                def record(*args: Any, **kwargs: Any) -> Tensor:
                    self.computed = original(base, *args, **kwargs)
                    return self.computed

                base.project_per_layer_inputs = record
            else:
                base.get_per_layer_inputs = lambda *args, **kwargs: None
                received = self.received
                base.project_per_layer_inputs = lambda *args, **kwargs: self._padded(received)
            yield

    def _padded(self, received: Tensor) -> Tensor:
        """The received slices at their layers' indices (the forward indexes the tensor by layer): zeros before."""
        if received.requires_grad:  # its gradient, sliced from the padded tensor's, is sent back: torch needs it whole
            received.register_hook(torch.Tensor.contiguous)
        before = received.new_zeros(*received.shape[:2], self.first, *received.shape[3:])
        return torch.cat([before, received], dim=2)

    def to_send(self, next_first: int) -> Tensor:
        """The slices of the layers from ``next_first`` on (the next stage's first block), for the next stage."""
        if self.received is not None:
            return self.received[:, :, next_first - self.first :].contiguous()
        if self.computed is None:
            raise PipelineModelError(
                f"{type(self.base).__name__} gives its layers per-layer inputs, but its forward did not compute them"
                " with `project_per_layer_inputs` on the first pipeline stage, so there is nothing to send the later"
                " stages. Call the model with `input_ids` (or `inputs_embeds`), not `per_layer_inputs`."
            )
        return self.computed[:, :, next_first:].contiguous()


def shared_kv_sources(base: nn.Module) -> dict[int, int]:
    """``{layer: the earlier layer whose keys and values it reuses}`` (Gemma 3n's and Gemma 4's
    ``num_kv_shared_layers``: their ``kv_sharing_modes`` say ``"reuse"`` and ``"store"``); empty without sharing."""
    config = getattr(base, "config", None)
    modes = list(getattr(config, "kv_sharing_modes", None) or ())
    if "reuse" not in modes:
        return {}
    types = list(config.layer_types)
    sources = {}
    for i, mode in enumerate(modes):
        source = max((j for j in range(i) if modes[j] == "store" and types[j] == types[i]), default=None)
        if mode == "reuse" and source is not None:
            sources[i] = source
    return sources


def shared_kv_ranges(base: nn.Module) -> tuple[tuple[int, int], ...]:
    """The ranges of layers (first and last index) that one stage must hold for every layer reusing keys and values
    to find them: each reusing layer with its source, overlapping ranges merged. Refuses sharing that goes through
    the decoding cache (transformers 4.x's Gemma 3n), which a stage does not keep in training."""
    config = getattr(base, "config", None)
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    if shared and getattr(config, "kv_sharing_modes", None) is None:
        raise PipelineModelError(
            f"{type(base).__name__} has `num_kv_shared_layers={shared}`, and in this transformers version its layers"
            " share keys and values only through the decoding cache, which pipeline stages run without"
            " (`use_cache=False`), so the shared layers would compute their own. Build the model with"
            " `num_kv_shared_layers=0`, or install transformers>=5, where the sharing does not need the cache."
        )
    ranges: list[tuple[int, int]] = []
    for first, last in sorted((source, layer) for layer, source in shared_kv_sources(base).items()):
        if ranges and first <= ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], max(last, ranges[-1][1]))
        else:
            ranges.append((first, last))
    return tuple(ranges)


def check_shared_kv(base: nn.Module, local: list[int]) -> None:
    """Refuse a stage holding a layer that reuses the keys and values of an earlier layer without holding that
    layer: they are not sent between stages."""
    for i in local:
        source = shared_kv_sources(base).get(i)
        if source is not None and source not in local:
            raise PipelineModelError(
                f"Layer {i} of {type(base).__name__} reuses the keys and values of layer {source}"
                f" (`num_kv_shared_layers={base.config.num_kv_shared_layers}`), which another pipeline stage holds:"
                f" they are not sent between stages. Put layers {source} to {i} on one stage (`balance=` as a list;"
                " the balanced splits do it where the stage count allows), use fewer stages, or build the model with"
                " `num_kv_shared_layers=0`."
            )
