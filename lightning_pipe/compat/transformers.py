"""Private transformers names used by lightning-pipe, one function each (checked with transformers 4.54-4.57, 5.x).

transformers is optional: nothing here imports it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

#: The per-module initialisation hook of ``PreTrainedModel`` (``_init_weights(module)``), which nanoGPT / GPT-2 style
#: models copy (``self.apply(self._init_weights)``). A model's own convention, read where the model defines it.
INIT_WEIGHTS = "_init_weights"


def init_weights_hook(module: Any) -> Optional[Callable[[Any], Any]]:
    """The module's ``_init_weights(module)`` when it defines one."""
    hook = getattr(module, INIT_WEIGHTS, None)
    return hook if callable(hook) else None


def head_pp_plan(model: Any) -> dict[str, Any]:
    """The task model's pipeline plan entries (``lm_head``): the class's ``_pp_plan`` with the instance's on top.

    The instance's ``_pp_plan`` holds the user's changes and also the base model's entries, prefixed (transformers >= 5)
    or not (4.x, whose ``post_init`` drops the class's heads from it). Public replacement: none (``model.pp_plan`` in
    5.x merges both in an order that puts the heads first).
    """
    return {**(getattr(type(model), "_pp_plan", None) or {}), **(model.__dict__.get("_pp_plan") or {})}


def set_head_pp_plan(model: Any, plan: dict[str, Any]) -> None:
    """Give the task model the head entries of a user's pipeline plan: the instance's ``_pp_plan``, which
    :func:`head_pp_plan` reads over the class's (transformers keeps the user's changes there too). Public replacement:
    none."""
    model._pp_plan = plan


def recorded_by(model: Any, output: str) -> Optional[tuple[tuple[type, int], ...]]:
    """The modules whose forward results transformers records as ``output`` (e.g. ``"router_logits"``) while the
    model runs, from the model class's ``_can_record_outputs`` (4.54+ and 5.x): ``(class, index)`` pairs, ``index``
    being the position of the value in the module's output tuple. ``None`` where the model does not record it that
    way or names the modules otherwise. Public replacement: none."""
    spec = (getattr(type(model), "_can_record_outputs", None) or {}).get(output)
    if spec is None:
        return None
    found = []
    for entry in spec if isinstance(spec, list) else [spec]:
        target = entry if isinstance(entry, type) else getattr(entry, "target_class", None)
        if not isinstance(target, type) or getattr(entry, "layer_name", None):
            return None
        found.append((target, 1 if isinstance(entry, type) else int(getattr(entry, "index", 0))))
    return tuple(found)


def head_tp_plan(model: Any) -> dict[str, str]:
    """The task model's tensor-parallel plan entries (``"lm_head": "colwise_rep"``): the class's ``_tp_plan`` with the
    instance's on top.

    The instance's ``_tp_plan`` (set by ``post_init``) also holds the base model's entries: prefixed in transformers
    5 (with ``"model.embed_tokens": "embedding_rowwise"`` when the embeddings are tied), both prefixed and not in 4.x.
    Public replacement: ``model.tp_plan`` (a property over the same dict in 4.x; absent in some 5.x versions).
    """
    return {**(getattr(type(model), "_tp_plan", None) or {}), **(model.__dict__.get("_tp_plan") or {})}


def keys_to_ignore(model: Any) -> tuple[list[str], list[str]]:
    """Regular expressions of the state-dict keys ``from_pretrained`` does not report missing, and of the stored keys
    it does not report unexpected, for this model (``_keys_to_ignore_on_load_missing`` / ``_unexpected``, class
    attributes of ``PreTrainedModel``; ``[]`` for other modules). Public replacement: none."""
    missing = getattr(model, "_keys_to_ignore_on_load_missing", None) or []
    unexpected = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    return list(missing), list(unexpected)


def legacy_names(model: Any) -> dict[str, str]:
    """``{stored pattern: network name}`` of the names older directories of this class store its weights under
    (Llava in transformers 4.x saves ``language_model.model.*`` for ``model.language_model.*``), from the class's
    ``_checkpoint_conversion_mapping``, which ``from_pretrained`` applies (4.x). Public replacement: none (5.x
    converts through ``transformers.conversion_mapping``)."""
    mapping = getattr(model, "_checkpoint_conversion_mapping", None) or {}
    return {str(k): str(v) for k, v in mapping.items()}


def generation_cache(config: Any, cache_class: Any = None) -> Any:
    """An empty cache of the kind ``generate`` makes by default for a model of ``config`` in the installed version,
    built by ``cache_class`` (``DynamicCache`` or a subclass): ``cache_class(config=config)`` where ``DynamicCache``
    takes a config (checked: 4.57, 5.x; one layer kind per ``config.layer_types``, sliding-window layers keeping only
    the window), else ``cache_class()`` (checked: 4.54; full layers made on their first update, the window applied by
    the masks alone; its cache layers refuse the arguments a config brings). Public replacement: none (``generate``
    builds its cache in the private ``_prepare_cache_for_generation``)."""
    import inspect

    from transformers import DynamicCache

    cache_class = cache_class or DynamicCache
    if "config" in inspect.signature(DynamicCache.__init__).parameters:
        return cache_class(config=config)
    return cache_class()


def mask_sizes(cache: Any, cache_position: Any, layer_idx: int) -> tuple[int, int]:
    """``cache.get_mask_sizes`` for the new tokens at ``cache_position``: given the positions (4.x) or their number
    (5.x, ``query_length``)."""
    import inspect

    from transformers import Cache

    first = list(inspect.signature(Cache.get_mask_sizes).parameters)[1]  # after self
    return cache.get_mask_sizes(cache_position.shape[0] if first == "query_length" else cache_position, layer_idx)


#: The forward arguments a key/value cache travels in (and the output field it comes back in): ``past_key_values``
#: (4.x) and ``cache`` (5.x, whose ``generate`` passes ``cache=``; ``past_key_values`` a deprecated alias there).
CACHE_ARGUMENTS = ("past_key_values", "cache")


def cache_argument(call: dict[str, Any]) -> Optional[str]:
    """The name under which the network call ``call`` (by argument name) passes a cache, ``None`` when it passes
    none."""
    return next((name for name in CACHE_ARGUMENTS if call.get(name) is not None), None)


def token_mean_losses() -> dict[Callable[..., Any], bool]:
    """transformers' loss functions that average a cross-entropy over the labels that are not ``ignore_index``, with
    whether each shifts the labels by one (causal LM) or not (masked LM, token classification). Public module
    (``transformers.loss.loss_utils``, 4.46+ and 5.x) but no documented list; read by identity with
    ``model.loss_function``."""
    from transformers.loss import loss_utils

    return {
        loss_utils.ForCausalLMLoss: True,
        loss_utils.ForMaskedLMLoss: False,
        loss_utils.ForTokenClassification: False,
    }


#: where ``PreTrainedModel.loss_function``'s setter keeps a function set on the instance
_LOSS_FUNCTION = "_loss_function"


def has_own_loss_function(model: Any) -> bool:
    """Whether a loss function was set on the instance (``model.loss_function = fn``, kept in ``_loss_function``).
    Public replacement: none."""
    return _LOSS_FUNCTION in model.__dict__


def replace_loss_function(model: Any, fn: Callable[..., Any]) -> Callable[[], None]:
    """Make ``model.loss_function`` return ``fn`` (its public setter) and return what puts the model's own back: its
    previous instance function, or none (the property's ``_loss_function``, which the setter writes and no public API
    removes). Public replacement: none."""
    had = _LOSS_FUNCTION in model.__dict__
    previous = model.__dict__.get(_LOSS_FUNCTION)
    model.loss_function = fn

    def restore() -> None:
        if had:
            model.__dict__[_LOSS_FUNCTION] = previous
        else:
            model.__dict__.pop(_LOSS_FUNCTION, None)

    return restore


@contextmanager
def init_on_meta() -> Iterator[None]:
    """Inside: a transformers (>= 5) model built on the meta device runs its init (``initialize_weights``), as it does
    on a real device, so that the strategy records it and replays it in one device's order; transformers skips it
    when ``modeling_utils.get_torch_context_manager_or_global_device()`` is the meta device. A no-op for transformers
    4.x (which runs it there) and when transformers is not imported yet. Public replacement: none."""
    import importlib
    import sys

    # transformers imports its modules lazily: a model class first named inside `configure_model` loads it there
    utils = importlib.import_module("transformers.modeling_utils") if "transformers" in sys.modules else None
    found = getattr(utils, "get_torch_context_manager_or_global_device", None)
    if found is None:
        yield
        return

    def not_meta() -> Any:
        device = found()
        return None if getattr(device, "type", None) == "meta" else device

    utils.get_torch_context_manager_or_global_device = not_meta  # type: ignore[union-attr]
    try:
        yield
    finally:
        utils.get_torch_context_manager_or_global_device = found  # type: ignore[union-attr]
