"""Hugging Face model directories as a starting point: each rank reads its own stages' tensors, memory-mapped.

A Hugging Face model directory (what ``save_pretrained`` writes, and how every pretrained model ships)::

    config.json                          the model's config
    generation_config.json               generation defaults (models that generate)
    model.safetensors                    the weights in one file, or in shards:
    model-00001-of-00003.safetensors     ...
    model.safetensors.index.json         {"metadata": {"total_size": N}, "weight_map": {name: shard file}}
    pytorch_model.bin[.index.json]       torch.save's format, older models (read too)

Names in it are the network's own (``model.layers.0.mlp.up_proj.weight``, without the LightningModule's attribute),
and a weight tied to another is stored once (``lm_head.weight`` is left out when it is the input embedding).

Everything here is local to one process: :func:`lightning_pipe.checkpoint.io.load_pretrained` runs it on every rank
(through :class:`~lightning_pipe.models.huggingface.files.HuggingFaceFiles`) and agrees on the errors. A
safetensors file is read through memory mappings of at most :data:`READ_BYTES` each (rows of a larger tensor through
:meth:`get_slice`), every mapping closed before the next: a rank's resident memory grows by its parameters and one
piece, not by the files' size nor by a tensor's.
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_pipe.errors import PipelineCheckpointError
from lightning_pipe.models.base import ModelKind
from lightning_pipe.models.files import Assign, LoadPlan, copy_whole, format_keys, load_mapped
from lightning_pipe.structures import is_dtensor

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
#: The files that hold a directory's weights, in the order transformers prefers them.
WEIGHT_FILES = (SAFETENSORS_INDEX, SAFETENSORS, BIN_INDEX, BIN)
#: Weights of other frameworks, which transformers can write and lightning-pipe does not read.
OTHER_FORMATS = ("tf_model.h5", "flax_model.msgpack", "model.ckpt.index")
#: The most bytes read through one memory mapping: what a load adds to the parameters' resident memory.
READ_BYTES = 16 * 2**20
_ELEMENT_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


def is_hf_directory(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face model directory (a config or weights file). A lightning-pipe checkpoint
    directory is told apart first, by its manifest (:func:`lightning_pipe.checkpoint.io.pretrained_files`)."""
    path = Path(path)
    if not path.is_dir():
        return False
    return any((path / name).is_file() for name in (*WEIGHT_FILES, CONFIG, *OTHER_FORMATS))


@dataclass(frozen=True)
class Directory:
    """The weights of a Hugging Face model directory, indexed without reading a tensor."""

    path: Path
    #: ``"safetensors"`` or ``"bin"``
    kind: str
    #: stored name -> the file holding it (relative to ``path``)
    files: dict[str, str]
    #: the ``model_type`` of ``config.json`` (``None`` without one)
    model_type: str | None
    #: the model classes of ``config.json`` (``architectures``: ``["LlamaForCausalLM"]``; empty without one)
    architectures: tuple[str, ...] = ()


def new_head_notice(path: Path, network: nn.Module) -> str | None:
    """With ``init_values='one_device'``: what to say when the directory ``path`` holds another model class than
    ``network`` (a causal LM's weights under a classifier), whose head is new to it. One device's ``from_pretrained``
    initialises such a head after loading, where the replay of ``configure_model``'s draws does not; ``None`` when the
    classes agree or the directory names none."""
    architectures = _config(Path(path) / CONFIG).get("architectures")
    base = network.get_base_model() if callable(getattr(network, "get_base_model", None)) else network
    ours = type(base).__name__
    if not isinstance(architectures, list) or not architectures or ours in architectures:
        return None
    peft = base is not network
    return (
        f"`init_values='one_device'` with `init_weights={str(path)!r}`, which holds a {architectures[0]}, not a"
        f" {ours}: the weights new to it (a task head) are drawn where one device's `from_pretrained` does not draw"
        " them, so their values and the random stream after them are not one device's"
        + (", nor the same in every layout (PEFT)" if peft else "")
        + ". Pass `init_values='per_unit'` for values that are the same in every layout."
    )


def read_directory(path: Path) -> Directory:
    """Index the weights of the Hugging Face model directory ``path`` from its index file or its single file."""
    path = Path(path)
    found = [name for name in WEIGHT_FILES if (path / name).is_file()]
    if not found:
        others = [name for name in OTHER_FORMATS if (path / name).exists()]
        raise PipelineCheckpointError(
            "it holds no weights lightning-pipe can read"
            + (f" ({', '.join(others)}: TensorFlow or Flax weights)" if others else "")
            + f". Expected {SAFETENSORS} (or shards listed in {SAFETENSORS_INDEX}) or {BIN}: save the model with"
            " `model.save_pretrained(path)`, which writes safetensors."
        )
    name = found[0]
    kind = "safetensors" if name.startswith(SAFETENSORS) else "bin"
    if name.endswith(".index.json"):
        files = _weight_map(path / name)
        absent = sorted({f for f in files.values() if not (path / f).is_file()})
        if absent:
            raise PipelineCheckpointError(
                f"{name} lists shards that are not in the directory: {format_keys(absent)}. The download or copy"
                " is incomplete: fetch the missing files."
            )
    else:
        files = dict.fromkeys(stored_names(path / name, kind), name)
    config = _config(path / CONFIG)
    model_type, architectures = config.get("model_type"), config.get("architectures")
    return Directory(
        path,
        kind,
        files,
        model_type if isinstance(model_type, str) else None,
        tuple(a for a in architectures if isinstance(a, str)) if isinstance(architectures, list) else (),
    )


def _weight_map(index: Path) -> dict[str, str]:
    try:
        found = json.loads(index.read_text())
        weight_map = found.get("weight_map") if isinstance(found, dict) else None
        problem = f"its 'weight_map' is {type(weight_map).__name__}"
    except (OSError, ValueError) as err:
        weight_map, problem = None, str(err)
    if not isinstance(weight_map, dict):
        raise PipelineCheckpointError(
            f"{index.name} is not a weight index (a JSON object whose 'weight_map' maps names to files): {problem}."
        )
    return dict(weight_map)


def stored_names(file: Path, kind: str) -> list[str]:
    if kind == "bin":
        return list(_load_bin(file))
    with _open(file) as f:
        return list(f.keys())


def _config(config: Path) -> dict[str, Any]:
    try:
        found = json.loads(config.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _open(file: Path) -> Any:
    """``safe_open`` of ``file`` (a memory mapping), its errors as :class:`PipelineCheckpointError`."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as err:
        raise PipelineCheckpointError(
            f"{file.name} cannot be read as safetensors ({err}): corrupted or truncated?"
        ) from err


def _load_bin(file: Path) -> Mapping[str, torch.Tensor]:
    try:
        return load_mapped(file)
    except (RuntimeError, pickle.UnpicklingError, EOFError) as err:
        raise PipelineCheckpointError(f"{file.name} cannot be read ({err}): corrupted or truncated?") from err


# ---------------------------------------------------------------------------------------------------- names
def resolve_names(
    local: Iterable[str],
    stored: Iterable[str],
    *,
    network_prefix: str,
    groups: Iterable[Sequence[str]] = (),
    disk_names: Callable[[str], Iterable[str]] = lambda name: (name,),
) -> tuple[dict[str, str], set[str]]:
    """Map each of this rank's state-dict keys (LightningModule names) to the stored name holding its value; also
    return the stored names that tied parameters leave unread.

    A key is looked up without ``network_prefix`` (the LightningModule's attribute, ``"model."``), under each name
    ``disk_names`` gives for it (the model kind's: a transformers task model's key also with its base model's prefix
    removed or added, so a base model's directory loads into its task model and the other way round). A tied
    parameter (``groups``: the names of one parameter, the first the one transformers keeps) takes the value stored
    under the first of its group's names that the directory holds, whichever name it has on this rank
    (``lm_head.weight`` is stored as ``model.embed_tokens.weight``): every copy of it on every rank starts equal, and
    the group's other stored names are left unread, as transformers ties them too. Keys found under no name are left
    out (the caller reports them).
    """
    stored = set(stored)
    group_of = {name: tuple(group) for group in groups for name in group}
    found: dict[str, str] = {}
    unread: set[str] = set()
    for key in local:
        present = [n for alias in group_of.get(key, (key,)) for n in disk_names(_relative(alias, network_prefix))]
        present = list(dict.fromkeys(n for n in present if n in stored))
        if present:
            found[key] = present[0]
            unread.update(present[1:])
    return found, unread - set(found.values())


def _relative(key: str, prefix: str) -> str:
    return key[len(prefix) :] if prefix and key.startswith(prefix) else key


def matching(names: Iterable[str], patterns: Sequence[str]) -> set[str]:
    """The ``names`` one of the regular expressions ``patterns`` finds (transformers' keys to ignore)."""
    return {n for n in names if any(re.search(p, n) for p in patterns)}


# ---------------------------------------------------------------------------------------------------- plan
def plan_load(
    path: Path,
    state: Mapping[str, Any],
    network: nn.Module,
    kind: ModelKind,
    network_prefix: str,
    groups: Iterable[Sequence[str]] = (),
) -> LoadPlan:
    """Match this rank's ``state`` (its stages' state dict under the LightningModule's names) to the tensors of the
    Hugging Face directory ``path``: ``network`` is the module's ``network_prefix`` attribute, ``kind`` its model
    kind (its names on disk), ``groups`` the names of each tied parameter (tied in the module, or across stages).

    Raises :class:`PipelineCheckpointError` for a directory of another model type or tensors of other shapes.
    """
    directory = read_directory(path)
    _check_model_type(directory, network, kind.directory_type(network))
    local = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    names, unread = resolve_names(
        local,
        directory.files,
        network_prefix=network_prefix,
        groups=groups,
        disk_names=lambda name: kind.disk_names(network, name),
    )
    skip_missing, skip_unexpected = kind.ignored_on_load(network)
    relative = {k: k[len(network_prefix) :] if k.startswith(network_prefix) else k for k in local}
    missing = sorted(k for k in local if k not in names and not matching([relative[k]], skip_missing))
    head, other_head = kind.new_weights(
        network, directory.architectures, [relative[k] for k in missing], directory.files
    )
    missing = [k for k in missing if relative[k] not in head]
    _check_shapes(directory, {k: tuple(local[k].shape) for k in names}, names)
    targets: dict[str, list[torch.Tensor]] = {}
    for key, name in names.items():
        filled = targets.setdefault(name, [])
        if all(_storage(t) != _storage(local[key]) for t in filled):  # one copy per storage
            filled.append(local[key])
    ignorable = unread | matching(directory.files, skip_unexpected) | other_head - set(names.values())
    new = sorted(k for k in local if relative[k] in head)
    return LoadPlan(directory, targets, missing, ignorable, new)


def _storage(t: torch.Tensor) -> int:
    return (t.to_local() if is_dtensor(t) else t).data_ptr()  # a DTensor has no storage of its own: its shard's


def _check_model_type(directory: Directory, network: nn.Module, model_type: str | None) -> None:
    if directory.model_type and model_type is not None and directory.model_type != model_type:
        raise PipelineCheckpointError(
            f"it holds a {directory.model_type!r} model (its config.json) but the network is a"
            f" {type(network).__name__} ({model_type!r}). Build the network from the directory's config in"
            " `configure_model`: `AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))`."
        )


def _check_shapes(directory: Directory, expected: Mapping[str, tuple[int, ...]], names: Mapping[str, str]) -> None:
    stored = stored_shapes(directory, set(names.values()))
    wrong = [
        f"{names[k]!r} is {list(stored[names[k]])} in the directory but {list(shape)} in the model ({k!r})"
        for k, shape in expected.items()
        if stored[names[k]] != shape
    ]
    if wrong:
        more = f"; and {len(wrong) - 4} more" if len(wrong) > 4 else ""
        raise PipelineCheckpointError(
            "shape mismatch: " + "; ".join(wrong[:4]) + more + ". The network was not built from the directory's"
            " config: build it from `AutoConfig.from_pretrained(path)` in `configure_model`."
        )


def stored_shapes(directory: Directory, names: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """Shapes of the stored tensors ``names``, from the safetensors headers or the mapped ``.bin`` files."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file, group in _by_file(directory, names).items():
        if directory.kind == "bin":
            loaded = _load_bin(directory.path / file)
            shapes.update((n, tuple(loaded[n].shape)) for n in group)
            continue
        with _open(directory.path / file) as f:
            shapes.update((n, tuple(f.get_slice(n).get_shape())) for n in group)
    return shapes


def _by_file(directory: Directory, names: Iterable[str]) -> dict[str, list[str]]:
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(directory.files[name], []).append(name)
    return dict(sorted(by_file.items()))


def new_head_message(path: Path, network: nn.Module, directory: Directory, keys: Sequence[str]) -> str:
    """The warning for a task head that the directory ``path`` (a model of another class) does not hold."""
    return (
        f"The Hugging Face model directory {str(path)!r} holds a {'/'.join(directory.architectures)}, not a"
        f" {type(network).__name__}: the model's {format_keys(keys)} are not in it and keep the model's own"
        " initialisation (`_init_weights`, as `from_pretrained` initialises a new head); its own head is left"
        " unread. Train the head (it starts untrained), or start from a directory of this class."
    )


def mismatch_message(path: Path, missing: Sequence[str], unexpected: Sequence[str], strict: bool) -> str:
    """The error (``strict``) or warning for keys that the model and the directory ``path`` do not share."""
    parts = []
    if missing:
        parts.append(f"the model's {format_keys(missing)} are not in it")
    if unexpected:
        parts.append(f"it holds {format_keys(unexpected)}, which the model does not have")
    what = f"The Hugging Face model directory {str(path)!r} does not match the model: {'; '.join(parts)}."
    if not strict:
        return what + " `strict_loading` is False: the missing ones keep the model's own initialisation."
    return (
        what + " Build the network from the directory's config (`AutoConfig.from_pretrained(path)`), or set"
        " `self.strict_loading = False` in the LightningModule to keep the model's own initialisation for missing"
        " weights and ignore the others."
    )


# ---------------------------------------------------------------------------------------------------- reading
def copy_into(plan: LoadPlan, assign: Assign = copy_whole) -> int:
    """Copy each planned stored tensor into its target tensors (converting dtype and device) with ``assign`` (the
    checkpoint code's puts a DTensor's part of the whole tensor into it); returns bytes read."""
    directory = plan.directory
    read = 0
    with torch.no_grad():
        for file, names in _by_file(directory, plan.targets).items():
            if directory.kind == "bin":
                read += _copy_bin(directory.path / file, names, plan.targets, assign)
            else:
                read += _copy_safetensors(directory.path / file, names, plan.targets, assign)
    return read


#: ``(name, rows)`` read through one mapping: ``rows`` a ``(start, stop)`` range of a large tensor, or ``None``
Piece = list[tuple[str, tuple[int, int] | None]]


def _copy_safetensors(
    file: Path, names: Sequence[str], targets: Mapping[str, Sequence[torch.Tensor]], assign: Assign
) -> int:
    read = 0
    split = [name for name in names if any(is_dtensor(t) for t in targets[name])]
    for piece in pieces(_sizes(file, names, split), READ_BYTES):
        # A mapping per piece: the file pages it touched leave the resident set when it closes.
        with _open(file) as f:
            for name, rows in piece:
                value = f.get_tensor(name) if rows is None else f.get_slice(name)[rows[0] : rows[1]]
                for target in targets[name]:
                    assign(target if rows is None else target[rows[0] : rows[1]], value)
                read += value.numel() * value.element_size()
                del value
    return read


def _sizes(file: Path, names: Sequence[str], whole: Iterable[str] = ()) -> list[tuple[str, int, int]]:
    """``(name, rows, bytes)`` of each tensor, from the file's header; the tensors ``whole`` as one row (read in
    one piece: they fill DTensors, which take their slice of the whole tensor)."""
    whole = set(whole)
    sizes = []
    with _open(file) as f:
        for name in names:
            view = f.get_slice(name)
            shape = view.get_shape()
            numel = 1
            for d in shape:
                numel *= d
            sizes.append(
                (name, shape[0] if shape and name not in whole else 1, numel * _ELEMENT_BYTES.get(view.get_dtype(), 1))
            )
    return sizes


def pieces(sizes: Sequence[tuple[str, int, int]], limit: int) -> Iterator[Piece]:
    """Group ``(name, rows, bytes)`` tensors into pieces of at most ``limit`` bytes, in order; a larger tensor is
    cut into row ranges ``(start, stop)`` of at most ``limit`` bytes (a single row may exceed it)."""
    piece: Piece = []
    size = 0
    for name, rows, nbytes in sizes:
        if nbytes > limit and rows > 1:
            if piece:
                yield piece
                piece, size = [], 0
            step = max(1, limit * rows // nbytes)
            for start in range(0, rows, step):
                yield [(name, (start, min(start + step, rows)))]
            continue
        if piece and size + nbytes > limit:
            yield piece
            piece, size = [], 0
        piece.append((name, None))
        size += nbytes
    if piece:
        yield piece


def _copy_bin(file: Path, names: Sequence[str], targets: Mapping[str, Sequence[torch.Tensor]], assign: Assign) -> int:
    # One pickle per file: its tensors share one mapping, released when the loaded dict is dropped.
    loaded = _load_bin(file)
    read = 0
    for name in names:
        for target in targets[name]:
            assign(target, loaded[name])
        read += loaded[name].numel() * loaded[name].element_size()
    return read
