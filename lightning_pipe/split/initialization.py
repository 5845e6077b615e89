"""Initial weights of a network built on the meta device and cut to a rank's stages: the model's own init.

After the split, each rank allocates its stages (``to_empty``) and replays what ``configure_model`` did to them on
the meta device, recorded by the strategy (:mod:`lightning_pipe.split.deferred_init`: ``apply(fn)``, ``nn.init``
loops, ``p.data.normal_()``, the model's own ``__init__`` init). Tensors still unset after that (or every tensor,
without a recording: :func:`initialize` called by hand) get the first of these that the model has:

1. ``_init_weights(module)`` (Hugging Face ``PreTrainedModel``, nanoGPT / GPT-2 style ``self.apply(
   self._init_weights)``): called on every module of the network, children before parents as ``nn.Module.apply``
   does. The method of the nearest enclosing module that defines it is used (a Hugging Face sub-model uses its
   own, as ``PreTrainedModel.initialize_weights`` does); if the network defines none, the LightningModule's
   (``owner``) is used.
2. ``init_weights()`` with no required argument (torchtitan): the network's is called once per unit, each time on
   a view of the network that holds only that unit, so it must skip units that are ``None`` (as the pipelined
   ``forward`` already does). Without one on the network, a submodule's ``init_weights()`` initialises that
   submodule (its descendants are then left to it).
3. ``reset_parameters()`` of each module (PyTorch's defaults), also for any tensor the hooks above left unset.

Every call runs under its own seed, ``seed + crc32(name)`` of the module or unit it initialises, so the weights
are the same whatever the pipeline layout and whichever rank holds them. With a recording and
``init_values="one_device"`` the recording is replayed first in one device's order from one device's random streams
(:meth:`~lightning_pipe.split.deferred_init.InitRecording.replay_in_order`), and a tensor it leaves unset for these
hooks is named in a warning: its values are per-unit draws, not one device's.

They equal a single-device run's bitwise when that run builds the same network on the meta device and calls
:func:`initialize` with the same seed on the same device type, which is what ``Trainer(strategy="pipeline")`` does
with ``pipeline_size=1`` (and what :func:`initialize` does when called by hand). A run that initialises eagerly in
``__init__`` draws all modules from one random stream, so it gets the same distribution (the model's own init) but
other numbers; CPU and CUDA random streams differ too.

A tensor that nothing set (without a recording: one created in ``__init__`` with a value, ``torch.ones`` for a norm's
weight or a causal mask buffer, whose value the meta device cannot keep) is found by filling every tensor with a
marker first (NaN, or the smallest integer) and raises :class:`PipelineModelError` naming it.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_pipe.compat.transformers import INIT_WEIGHTS, init_weights_hook
from lightning_pipe.errors import PipelineModelError
from lightning_pipe.models import kind_of, restore_buffers
from lightning_pipe.split.seeding import seeded, unit_seed
from lightning_pipe.split.surgery import find_block, stage_view

if TYPE_CHECKING:
    from lightning_pipe.split.deferred_init import InitRecording

__all__ = [
    "WHOLE_MODEL_WARN_BYTES",
    "init_hook",
    "initialize",
    "loaded_names",
    "seeded",
    "unit_seed",
    "warn_whole_model",
]

#: Below this many bytes of parameters and buffers, building the network whole on every rank (in ``__init__``) costs
#: too little memory to warn about; above it, building in ``configure_model`` saves real memory.
WHOLE_MODEL_WARN_BYTES = 256 * 2**20


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False)
    yield from ((n, b) for n, b in module.named_buffers(recurse=False) if b is not None)


def _mark(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


def _unset(t: torch.Tensor) -> bool:
    """Whether ``t`` still holds the marker anywhere (booleans cannot be marked and count as set)."""
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    marker = torch.iinfo(t.dtype).min if not (t.is_floating_point() or t.is_complex()) else None
    # In chunks: a check of the whole tensor would allocate a mask a quarter of its size (fp32) on top of the stage.
    for chunk in t.reshape(-1).split(1 << 20):
        if bool(torch.isnan(chunk).any() if marker is None else (chunk == marker).any()):
            return True
    return False


def _no_required_args(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def init_hook(network: nn.Module, owner: nn.Module | None = None) -> str:
    """Which hook :func:`initialize` uses: ``"_init_weights"``, ``"init_weights"`` or ``"reset_parameters"``."""
    if any(init_weights_hook(m) is not None for m in (network, owner) if m is not None):
        return INIT_WEIGHTS
    if any(callable(getattr(m, "init_weights", None)) and _no_required_args(m.init_weights) for m in network.modules()):
        return "init_weights"
    return "reset_parameters"


def _apply_init_weights(network: nn.Module, owner: nn.Module | None, seed: int, only_unset: bool) -> None:
    root_fn = init_weights_hook(network) or init_weights_hook(owner)

    def visit(module: nn.Module, name: str, fn: Callable[[nn.Module], Any]) -> None:
        own = init_weights_hook(module) if module is not network else None
        fn = own if own is not None else fn
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, fn)
        if only_unset:
            _keeping_set(dict(_own_tensors(module)), lambda: seeded(seed, name, lambda: fn(module)))
        else:
            seeded(seed, name, lambda: fn(module))

    assert root_fn is not None
    visit(network, "", root_fn)


def _keeping_set(tensors: dict[str, torch.Tensor], fn: Callable[[], Any]) -> None:
    """Run ``fn`` (an init hook) if any of ``tensors`` is unset, and give the set ones their values back."""
    kept = {n: t.clone() for n, t in tensors.items() if not _unset(t)}
    if len(kept) == len(tensors):
        return
    fn()
    for n, value in kept.items():
        tensors[n].copy_(value)


def _apply_unit_init_weights(network: nn.Module, units: Sequence[str], seed: int, only_unset: bool) -> None:
    root = getattr(network, "init_weights", None)

    def run(module: nn.Module, name: str, fn: Callable[[], Any]) -> None:
        if only_unset:
            tensors = dict([*module.named_parameters(), *module.named_buffers()])
            _keeping_set(tensors, lambda: seeded(seed, name, fn))
        else:
            seeded(seed, name, fn)

    if callable(root) and _no_required_args(root):
        present = [u for u in units if find_block(network, u) is not None]
        for unit in present:
            view = stage_view(network, [unit], units)
            run(network.get_submodule(unit), unit, view.init_weights)
        return

    def visit(module: nn.Module, name: str) -> None:
        fn = getattr(module, "init_weights", None)
        if module is not network and callable(fn) and _no_required_args(fn):
            run(module, name, fn)
            return
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    visit(network, "")


def _reset_unset(network: nn.Module, seed: int) -> list[str]:
    """``reset_parameters()`` for modules with tensors still unset, keeping the tensors a hook did set; returns
    the names of tensors that stay unset."""
    missing = []
    for name, module in network.named_modules():
        own = dict(_own_tensors(module))
        unset = {n for n, t in own.items() if _unset(t)}
        if not unset:
            continue
        reset = getattr(module, "reset_parameters", None)
        if restore_buffers(module):
            unset = {n for n, t in dict(_own_tensors(module)).items() if _unset(t)}
        elif callable(reset):
            kept = {n: t.clone() for n, t in own.items() if n not in unset}
            seeded(seed, name, reset)
            for n, value in kept.items():
                own[n].copy_(value)
            unset = {n for n, t in dict(_own_tensors(module)).items() if _unset(t)}
        missing += [f"{name}.{n}" if name else n for n in sorted(unset)]
    return missing


def initialize(
    network: nn.Module,
    device: torch.device,
    seed: int,
    *,
    units: Sequence[str] = (),
    owner: nn.Module | None = None,
    recording: InitRecording | None = None,
    prefix: str = "",
    init_values: str = "per_unit",
    loaded: frozenset[str] = frozenset(),
) -> str:
    """Allocate a (pruned) meta-device ``network`` on ``device`` and initialise it with the model's own init.

    ``units``: the layout's units (``Layout.units``), used by the ``init_weights()`` hook; ``owner``: the
    LightningModule, whose ``_init_weights(module)`` is used if the network has none; ``recording``: what
    ``configure_model`` did to the meta tensors (:mod:`lightning_pipe.split.deferred_init`), replayed first, the
    hooks then setting only what it left unset; ``prefix``: the network's attribute in the full model (``"model."``);
    ``init_values``: the recording's order (``"one_device"`` or ``"per_unit"``); ``loaded``: the full model's names of
    tensors ``init_weights`` loads from a Hugging Face directory (:func:`loaded_names`), not drawn in one device's
    order. Returns the hook used (``"recorded"`` when the recording set every tensor).
    """
    network.to_empty(device=device)
    hook = init_hook(network, owner)
    with torch.no_grad():
        for module in network.modules():
            for _, t in _own_tensors(module):
                _mark(t)
        if recording is not None and init_values == "one_device":
            replayed = recording.replay_in_order(network, prefix, device, loaded)
            _warn_unset(network, prefix, loaded, hook)
        elif recording is not None:
            replayed = recording.replay(network, prefix, seed, device, defaults=hook == "reset_parameters")
        else:
            replayed = 0
        if replayed and not any(_unset(t) for m in network.modules() for _, t in _own_tensors(m)):
            return "recorded"
        if hook == INIT_WEIGHTS:
            _apply_init_weights(network, owner, seed, only_unset=replayed > 0)
        elif hook == "init_weights":
            _apply_unit_init_weights(network, units, seed, only_unset=replayed > 0)
        missing = _reset_unset(network, seed)
        if recording is not None:  # plain copies of tensors drawn at random: the original's value, now it has one
            copied = recording.copy_deferred(network, prefix)
            missing = [name for name in missing if name not in copied]
    if missing:
        raise PipelineModelError(
            f"Tensors {missing[:5]} of the network built on the meta device (in `configure_model`) are not set by"
            f" the model's init (`{hook}`) nor by a `reset_parameters()`: their values from `__init__` are lost on"
            " the meta device. Set them in `_init_weights(module)`, `init_weights()` or the module's"
            " `reset_parameters()`, or build the model in `__init__` instead of `configure_model`."
        )
    return hook


def loaded_names(network: nn.Module, prefix: str) -> frozenset[str]:
    """The names (``prefix`` + the network's) of the tensors a Hugging Face directory given as ``init_weights`` sets:
    the network's state dict but what its model kind says a directory may lack (PEFT adapters, ...)."""
    ignored = kind_of(network).ignored_on_load(network)[0]
    names = network.state_dict(keep_vars=True)
    return frozenset(prefix + n for n in names if not any(re.search(pattern, n) for pattern in ignored))


def _warn_unset(network: nn.Module, prefix: str, loaded: frozenset[str], hook: str) -> None:
    """After one device's replay: name the tensors still unset (an init that skips the meta device, as transformers
    5.x does) that the model's hooks will draw per unit, so not as one device."""
    unset = [
        n for n, t in [*network.named_parameters(), *network.named_buffers()] if prefix + n not in loaded and _unset(t)
    ]
    if unset:
        warnings.warn(
            f"`init_values='one_device'`: {len(unset)} tensors ({unset[:3]}) were not set by what `configure_model`"
            f" did on the meta device (an init that skips the meta device), so the model's `{hook}` sets them under"
            " per-unit seeds: their values are not one device's. Initialise them in `configure_model` (call the"
            " model's init there), or pass `init_values='per_unit'` to say that per-unit values are intended.",
            UserWarning,
            stacklevel=2,
        )


def warn_whole_model(network_bytes: int, kept_bytes: int) -> None:
    """Warn that every rank allocated the whole network (built in ``__init__``) before keeping its stages, when that
    is more than :data:`WHOLE_MODEL_WARN_BYTES` (a small model costs nothing worth a warning)."""
    if network_bytes < WHOLE_MODEL_WARN_BYTES:
        return
    from lightning.fabric.utilities.rank_zero import rank_zero_warn

    from lightning_pipe.measure.memory import format_bytes

    rank_zero_warn(
        f"The network was built in `__init__`, so every rank allocated all of it ({format_bytes(network_bytes)} of"
        f" parameters and buffers) before keeping its own stages ({format_bytes(kept_bytes)} on rank 0). Build it"
        " in the LightningModule's `configure_model` hook instead: there it is created on the meta device and each"
        " rank allocates only its stages, with the initial values and the shuffling DataLoader's order of a"
        " single-device run from the same seed (`init_values='one_device'`, docs/initialization.md).",
        category=UserWarning,
    )
