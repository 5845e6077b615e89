"""What cached decoding needs to know about a transformers model: the key/value cache each stage keeps of its own
layers, the row chunks of a decoding call, and which ``generate`` modes fit a pipeline.

transformers' own ``generate`` runs unchanged on every rank (:mod:`lightning_pipe.step.generation` drives it through
:class:`HuggingFaceDecoding`); each of its network calls is one pass through the stages. The cache object ``generate``
made and passes in is only carried along: every stage keeps, per row chunk, a cache holding its own layers' keys and
values (:func:`make_stage_cache`), and the forward of the stage (:func:`lightning_pipe.models.huggingface.stage.
prepare_call`) is given that one.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from lightning_pipe.compat.transformers import CACHE_ARGUMENTS, cache_argument, generation_cache
from lightning_pipe.errors import PipelineUsageError
from lightning_pipe.models.huggingface.plan import PassThrough, block_stack

#: the ``generate`` modes a pipeline decodes exactly: one token per row and per network call, no cache reordering
SUPPORTED_MODES = ("greedy_search", "sample")
#: arguments of a decoding call that are not per row (``cache_position`` has one entry per new token)
_NOT_ROWS = ("cache_position", *CACHE_ARGUMENTS, "logits_to_keep", "use_cache", "return_dict")


def make_stage_cache(view: nn.Module) -> Any:
    """A :class:`DynamicCache` for the layers of one stage view that answers, for the layers the stage does not
    hold, with the first held layer of the same kind (full or sliding window): the forward builds its masks from
    layer 0's (or the first sliding layer's) cache length, which a stage after the first does not hold."""
    from transformers import DynamicCache

    blocks = list(block_stack(view).children())
    own = [i for i, block in enumerate(blocks) if not isinstance(block, PassThrough)]

    class StageCache(DynamicCache):
        def _held(self, layer_idx: int) -> int:
            if layer_idx in own or layer_idx >= len(self.layers):
                return layer_idx
            sliding = self.is_sliding
            same = [i for i in own if i < len(sliding) and sliding[i] == sliding[layer_idx]]
            held = same[0] if same else own[0]
            # not made yet (4.54-4.55 make layers on their first update): nothing seen, as the layer asked about
            return held if held < len(self.layers) else layer_idx

        def get_seq_length(self, layer_idx: int = 0, *args: Any) -> int:
            return super().get_seq_length(self._held(layer_idx), *args)  # 4.54-4.55 also take cache_position

        def get_mask_sizes(self, query: Any, layer_idx: int) -> tuple[int, int]:
            # the new tokens' positions (4.x) or their number (5.x)
            return super().get_mask_sizes(query, self._held(layer_idx))

    return generation_cache(view.config, StageCache)


class StageCaches:
    """The caches of one row chunk during one ``generate`` call, one per stage view (made at its first call)."""

    def __init__(self) -> None:
        self._caches: dict[int, tuple[nn.Module, Any]] = {}

    def of(self, view: nn.Module, model: nn.Module | None = None) -> Any:
        """The cache of ``view``'s layers; ``model``: the transformers model the view runs (a PEFT view's
        ``base_model.model``; the view itself by default)."""
        held = self._caches.get(id(view))
        if held is None:
            held = self._caches[id(view)] = (view, make_stage_cache(view if model is None else model))
        return held[1]


class HuggingFaceDecoding:
    """A transformers model's ``generate`` under a pipeline (:class:`~lightning_pipe.models.base.Decoding`)."""

    def check(self, network: nn.Module, args: tuple, kwargs: dict) -> None:
        check_generate(network, args, kwargs)

    def generate(self, network: nn.Module, args: tuple, kwargs: dict) -> Any:
        return type(network).generate(network, *args, **kwargs)  # the class's: the instance's is the interceptor

    def rows(self, kwargs: dict) -> int:
        return rows_of(kwargs)

    def new_caches(self) -> StageCaches:
        return StageCaches()

    def chunk(self, kwargs: dict, rows: int, start: int, stop: int, caches: Any) -> dict:
        # generate(use_cache=False) passes no cache: every call recomputes the whole sequence, as on one device
        return chunk_call(kwargs, rows, start, stop, caches if cache_argument(kwargs) is not None else None)

    def merge(self, outputs: list[Any]) -> Any:
        return merge_chunks(outputs)

    def answer(self, output: Any, kwargs: dict) -> Any:
        return with_cache(output, kwargs)


def check_generate(network: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse, before anything runs, a ``generate`` call whose decoding a pipeline cannot reproduce exactly."""
    config = kwargs.get("generation_config")
    config = copy.deepcopy(config if config is not None else network.generation_config)
    rest = config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    mode = str(config.get_generation_mode(kwargs.get("assistant_model")).value)
    name = type(network).__name__
    if mode not in SUPPORTED_MODES:
        raise PipelineUsageError(
            f"{name}.generate(...) in {mode.replace('_', ' ')} mode (num_beams={config.num_beams},"
            f" penalty_alpha={config.penalty_alpha}, assistant_model={kwargs.get('assistant_model') is not None}) is"
            " not supported under PipelineParallelStrategy: each stage keeps only its own layers' cache and decodes"
            f" one token per row and per pass, so only {' and '.join(SUPPORTED_MODES)} are exact. Pass `num_beams=1`"
            " (and no assistant model or penalty_alpha)."
        )
    passed = cache_argument(rest)
    if config.cache_implementation is not None or passed is not None:
        what = (
            f"cache_implementation={config.cache_implementation!r}"
            if config.cache_implementation is not None
            else passed
        )
        raise PipelineUsageError(
            f"{name}.generate(...) was called with {what}: under PipelineParallelStrategy each stage keeps the"
            f" dynamic cache of its own layers. Leave the cache to `generate` (no `{passed or 'past_key_values'}`,"
            " `cache_implementation=None`)."
        )


def rows_of(kwargs: dict[str, Any]) -> int:
    """The number of rows (sequences) of a decoding call made by ``generate``."""
    for name in ("input_ids", "inputs_embeds"):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor):
            return int(value.shape[0])
    raise PipelineUsageError(
        f"`generate` called the network with neither `input_ids` nor `inputs_embeds` (got {sorted(kwargs)}), so its"
        " rows cannot be split into chunks."
    )


def chunk_call(kwargs: dict[str, Any], rows: int, start: int, stop: int, caches: StageCaches | None) -> dict[str, Any]:
    """The decoding call ``kwargs`` (by name) for rows ``start:stop`` of ``rows``, with that chunk's caches."""
    out = {}
    for name, value in kwargs.items():
        if name not in _NOT_ROWS and isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            value = value[start:stop]
        out[name] = value
    if caches is not None:
        out[cache_argument(kwargs)] = caches  # in place of generate's own cache, under the name it used
    return out


def merge_chunks(outputs: list[Any]) -> Any:
    """One decoding call's output from its chunks' outputs: the per-row tensors (logits) concatenated in row order;
    the stages' caches left out (the answer carries ``generate``'s own cache object instead)."""
    first = outputs[0]
    merged = {}
    for key, value in first.items():
        if key in CACHE_ARGUMENTS:
            continue
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            if len(outputs) > 1:
                raise PipelineUsageError(
                    f"The decoding call returned `{key}` ({type(value).__name__}), which cannot be merged over row"
                    " chunks. Call the model inside `generate` without labels."
                )
            merged[key] = value
            continue
        merged[key] = torch.cat([o[key] for o in outputs]) if len(outputs) > 1 else value
    return type(first)(**merged)


def with_cache(output: Any, kwargs: dict[str, Any]) -> Any:
    """``output`` as ``generate`` expects it back: carrying the cache object it passed in (``kwargs``), in the field
    of the same name."""
    name = cache_argument(kwargs)
    if name is not None:
        output[name] = kwargs[name]
    return output
