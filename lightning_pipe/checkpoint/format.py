"""The directory checkpoint format: file names, the manifest, and the checks a checkpoint must pass before loading.

Pure functions over paths, dicts, key names and shapes; no process group. A checkpoint directory holds::

    lightning_pipe.json         manifest: format version, pipeline layout at save time, what else is in the directory
    .metadata, __<r>_0.distcp   torch.distributed.checkpoint: model ("state_dict.<fqn>") and optimizer
                                ("optimizer_<i>.state.<fqn>.<name>", "optimizer_<i>.param_groups.<fqn>.<name>") entries
    trainer.pt                  everything else Lightning checkpoints (loops, callbacks, hyperparameters, ...)
    lr_schedulers/rank<p>.pt    the LR scheduler state dicts of pipeline rank ``p`` (``torch.save``)
    resume/rank<r>.pt           global rank ``r``'s resume point: its random streams and data-loader epoch starts
                                where training continued after the save (lightning_pipe.reliability.loaders)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_pipe.errors import PipelineCheckpointError
from lightning_pipe.models.files import format_keys

FORMAT_NAME = "lightning-pipe-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "lightning_pipe.json"
TRAINER_STATE = "trainer.pt"
SCHEDULER_DIR = "lr_schedulers"
DCP_METADATA = ".metadata"
MODEL_PREFIX = "state_dict."
#: manifest key: ``{other name: first name}`` of parameters shared by several stages (stored under the first name)
ALIASES = "tied_aliases"
#: Manifest key: per optimizer, per param group, the parameter names in one device's order (``optim.ParamGroups``).
#: Absent from checkpoints without optimizer state and from those written before it was recorded: readers of format
#: version 1 ignore keys they do not know, so adding it needed no new version.
PARAM_GROUPS = "optimizer_param_groups"
#: Manifest keys (also unknown to older readers of version 1): the trainer's progress and the time of the save (what
#: a restarted run compares to find the newest checkpoint), and the per-rank resume point files.
GLOBAL_STEP = "global_step"
EPOCH = "epoch"
SAVED_AT = "saved_at"
RESUME_FILES = "resume_files"
RESUME_DIR = "resume"
#: Manifest key (unknown to older readers too): what the network's kind records to export it (``ModelKind.record``;
#: a transformers network's class, config, generation config and the LightningModule's attribute holding it): what
#: ``export-hf`` writes ``config.json`` from. The name is historical: any kind's record is kept under it.
NETWORK_RECORD = "huggingface"
#: Manifest key (unknown to older readers too): the pipelined network's attribute in the saved module as a name prefix
#: (``"model."`` for a LightningModule's ``self.model``, ``""`` for a Fabric module or a LightningModule that is the
#: network). A loader whose prefix differs (a Trainer loading a Fabric checkpoint, or the other way round) reads the
#: network's entries under the saved prefix; a checkpoint without it was saved with the loader's prefix.
NETWORK_PREFIX = "network_prefix"
#: Manifest key (unknown to older readers too): ``{hyperparameter: {its state-dict name: the module's name}}`` of the
#: networks kept by ``save_hyperparameters()``, which ``trainer.pt`` holds on the meta device (checkpoint/hparams.py):
#: ``consolidate`` fills them with the weights.
HYPERPARAMETER_NETWORKS = "hyperparameter_networks"
#: Suffixes of the sibling directories a save or removal goes through; none of them is ever a checkpoint to load.
_TRANSIENT = re.compile(r"\.(tmp|old|trash)-[0-9a-f]+$")


# ---------------------------------------------------------------------------------------------------- paths
def temporary_path(path: Path, token: str) -> Path:
    """Where a save writes before it is complete: a sibling, so the final rename stays on one filesystem."""
    return path.with_name(f"{path.name}.tmp-{token}")


def replaced_path(path: Path, token: str) -> Path:
    """Where the previous checkpoint of the same name waits while the new one is renamed into place."""
    return path.with_name(f"{path.name}.old-{token}")


def trash_path(path: Path, token: str) -> Path:
    """Where a checkpoint goes before deletion, so a half-deleted directory never carries a checkpoint's name."""
    return path.with_name(f"{path.name}.trash-{token}")


def is_transient(path: Path) -> bool:
    """Whether ``path`` is a save's temporary directory, a replaced checkpoint or one being deleted."""
    return bool(_TRANSIENT.search(Path(path).name))


def leftovers(path: Path, kinds: Sequence[str] = ("tmp", "trash")) -> list[Path]:
    """Transient siblings of ``path`` of the given kinds, left by saves or removals that were killed."""
    pattern = re.compile(re.escape(path.name) + r"\.(" + "|".join(kinds) + r")-[0-9a-f]+$")
    if not path.parent.is_dir():
        return []
    return sorted(p for p in path.parent.iterdir() if pattern.fullmatch(p.name))


def checkpoint_name(path: Path) -> Path:
    """The checkpoint a transient directory belongs to (``last.ckpt`` for ``last.ckpt.tmp-1a2b``)."""
    path = Path(path)
    return path.with_name(_TRANSIENT.sub("", path.name))


def is_temporary(path: Path) -> bool:
    """Whether ``path`` is a save's temporary directory (``<name>.tmp-<id>``)."""
    return bool(re.search(r"\.tmp-[0-9a-f]+$", Path(path).name))


def is_trash(path: Path) -> bool:
    """Whether ``path`` is a checkpoint being deleted (``<name>.trash-<id>``)."""
    return bool(re.search(r"\.trash-[0-9a-f]+$", Path(path).name))


def scheduler_file(pipeline_rank: int) -> str:
    return f"{SCHEDULER_DIR}/rank{pipeline_rank}.pt"


def resume_file(global_rank: int) -> str:
    return f"{RESUME_DIR}/rank{global_rank}.pt"


# ---------------------------------------------------------------------------------------------------- manifest
def build_manifest(
    *,
    pipeline_size: int,
    data_parallel_size: int,
    stages_per_rank: int,
    schedule: str,
    optimizers: int,
    lr_schedulers: bool,
    module_class: str,
    param_groups: Sequence[Sequence[Sequence[str | None]]] | None = None,
    aliases: Mapping[str, str] | None = None,
    sharded: bool = False,
    tensor_parallel_size: int = 1,
) -> dict[str, Any]:
    """The manifest of a checkpoint saved by a pipeline of ``pipeline_size`` ranks.

    ``optimizers`` is how many optimizers' states are in it (0 for a weights-only checkpoint); ``lr_schedulers``
    whether each pipeline rank wrote its scheduler file; ``param_groups`` the optimizers' parameter order on one
    device, when known; ``aliases`` the other names of tied parameters (``{name: first name}``), stored once;
    ``sharded`` whether the data-parallel ranks wrote shards (FSDP) instead of one replica writing whole
    tensors, ``tensor_parallel_size`` over how many processes each stage's layers were split (informative: every
    layout loads into every other).
    """
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "pipeline_size": pipeline_size,
        "data_parallel_size": data_parallel_size,
        "data_parallel": "fsdp" if sharded else "ddp",
        "tensor_parallel_size": tensor_parallel_size,
        "stages_per_rank": stages_per_rank,
        "num_stages": pipeline_size * stages_per_rank,
        "schedule": schedule,
        "optimizers": optimizers,
        "lr_scheduler_files": [scheduler_file(r) for r in range(pipeline_size)] if lr_schedulers else [],
        "module_class": module_class,
    }
    if param_groups is not None:
        manifest[PARAM_GROUPS] = [[list(group) for group in optimizer] for optimizer in param_groups]
    if aliases:
        manifest[ALIASES] = dict(sorted(aliases.items()))
    return manifest


def describe(manifest: Mapping[str, Any]) -> str:
    """One line on what wrote the checkpoint, for error messages."""
    return (
        f"saved by {manifest.get('module_class', '?')} with pipeline_size={manifest.get('pipeline_size')},"
        f" tensor_parallel={manifest.get('tensor_parallel_size', 1)},"
        f" {manifest.get('stages_per_rank')} stage(s) per rank, schedule {manifest.get('schedule')}"
    )


def missing_checkpoint_message(path: Path) -> str:
    """Why ``path`` does not exist, pointing at what an interrupted save or replacement left behind."""
    message = f"Checkpoint {str(path)!r} does not exist."
    old = leftovers(path, ("old",))
    tmp = leftovers(path, ("tmp",))
    if old:
        message += (
            f" A save that was replacing it was interrupted after moving the previous complete checkpoint to"
            f" {str(old[-1])!r}: rename that directory back to {path.name!r} to load it."
        )
    elif tmp:
        message += f" {str(tmp[-1])!r} is an incomplete save (the process was interrupted); it cannot be loaded."
    return message


def read_manifest(path: Path) -> dict[str, Any]:
    """Read and validate the manifest of the checkpoint directory ``path``."""
    path = Path(path)
    if is_transient(path):
        raise PipelineCheckpointError(
            f"{str(path)!r} is a temporary directory of an interrupted save or removal, not a checkpoint. Load the"
            f" checkpoint without the '{path.suffix}' suffix."
        )
    if not path.exists():
        raise PipelineCheckpointError(missing_checkpoint_message(path))
    file = path / MANIFEST
    if not file.is_file():
        raise PipelineCheckpointError(
            f"{str(path)!r} has no {MANIFEST}: it is not a complete lightning-pipe checkpoint (an incomplete copy, or"
            " a directory written by another tool). Only directories that `PipelineParallelStrategy` saved, or that"
            " `python -m lightning_pipe.checkpoint` wrote, can be loaded."
        )
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise PipelineCheckpointError(f"The manifest {str(file)!r} is corrupted ({err}).") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise PipelineCheckpointError(f"{str(file)!r} is not a lightning-pipe manifest (no 'format': {FORMAT_NAME!r}).")
    if manifest.get("version") != FORMAT_VERSION:
        raise PipelineCheckpointError(
            f"{str(path)!r} has checkpoint format version {manifest.get('version')!r}; this lightning-pipe reads"
            f" version {FORMAT_VERSION}. Load it with the lightning-pipe version that wrote it and convert it with"
            " `python -m lightning_pipe.checkpoint consolidate`."
        )
    return manifest


def missing_files(path: Path, manifest: Mapping[str, Any], storage: Iterable[tuple[str, int]]) -> list[str]:
    """Problems with the files of checkpoint ``path``: listed ones that are missing, shards shorter than the metadata
    says (``storage``: ``(relative file, end offset)`` for every stored item)."""
    problems = []
    listed = (*manifest.get("lr_scheduler_files", []), *manifest.get(RESUME_FILES, []))
    for name in (TRAINER_STATE, DCP_METADATA, *listed):
        if not (path / name).is_file():
            problems.append(f"{name} is missing")
    ends: dict[str, int] = {}
    for rel, end in storage:
        ends[rel] = max(ends.get(rel, 0), end)
    for rel, end in sorted(ends.items()):
        file = path / rel
        if not file.is_file():
            problems.append(f"shard {rel} is missing")
        elif file.stat().st_size < end:
            problems.append(f"shard {rel} is truncated ({file.stat().st_size} of {end} bytes)")
    return problems


# ---------------------------------------------------------------------------------------------------- keys
def _entry_group(key: str) -> str:
    head = key.split(".", 1)[0]
    return "weights" if head == "state_dict" else f"{head.replace('_', ' ')} state"


def _display(key: str) -> str:
    return key[len(MODEL_PREFIX) :] if key.startswith(MODEL_PREFIX) else key


def key_problems(
    expected: Mapping[str, tuple[int, ...] | None], stored: Mapping[str, tuple[int, ...] | None]
) -> list[str]:
    """Entries this rank needs that the checkpoint lacks (weights first, then each optimizer's), and tensors whose
    stored shape differs.

    Both map a flat key to a tensor shape, or ``None`` for a non-tensor entry (an optimizer hyperparameter).
    """
    problems = []
    missing: dict[str, list[str]] = {}
    for key in expected:
        if key not in stored:
            missing.setdefault(_entry_group(key), []).append(_display(key))
    for group in sorted(missing, key=lambda g: (g != "weights", g)):
        problems.append(f"missing {group}: {format_keys(missing[group])}")
    shapes = [
        f"{_display(k)!r} is {list(stored[k])} in the checkpoint but {list(shape)} in the model"
        for k, shape in expected.items()
        if k in stored and shape is not None and stored[k] is not None and tuple(stored[k]) != tuple(shape)
    ]
    if shapes:
        more = f"; and {len(shapes) - 6} more" if len(shapes) > 6 else ""
        problems.append("shape mismatch: " + "; ".join(shapes[:6]) + more)
    return problems


def unexpected_keys(stored: Iterable[str], used: Iterable[str], prefix: str = MODEL_PREFIX) -> list[str]:
    """Stored entries under ``prefix`` that no rank loads: weights of units the model does not have."""
    used = set(used)
    return sorted(k for k in stored if k.startswith(prefix) and k not in used)


def strip_prefix(keys: Iterable[str], prefix: str) -> dict[str, str]:
    """Map each ``prefix``-ed key to the key without it (keys without the prefix are left out)."""
    return {k: k[len(prefix) :] for k in keys if k.startswith(prefix)}


def match_weight_keys(expected: Iterable[str], available: Iterable[str], network_prefix: str) -> dict[str, str]:
    """Map each expected LightningModule key to its name in a weights file.

    A file holds either the LightningModule's keys (``model.layers.0.fc1.weight``: a Lightning ``.ckpt``, or its
    ``state_dict()``), or the network's own (``layers.0.fc1.weight``: pretrained weights of the network alone, whose
    keys lack ``network_prefix``). The reading that finds more of the expected keys wins; missing ones are reported
    by the caller.
    """
    expected = list(expected)
    available = set(available)
    direct = {k: k for k in expected}
    if not network_prefix:
        return direct
    stripped = {k: k[len(network_prefix) :] if k.startswith(network_prefix) else k for k in expected}
    hits_direct = sum(k in available for k in direct.values())
    hits_stripped = sum(k in available for k in stripped.values())
    return stripped if hits_stripped > hits_direct else direct


def stored_names(names: Iterable[str], prefix: str, saved_prefix: str) -> dict[str, str]:
    """Each local name under the name a checkpoint stores it with: the network's names, under ``prefix`` here, under
    ``saved_prefix`` there; names outside the network (other attributes of a LightningModule) unchanged.

    Refuses two local names that would read one stored entry (a LightningModule attribute named like a network entry).
    """
    names = list(dict.fromkeys(names))
    if prefix == saved_prefix:
        return {n: n for n in names}
    mapped = {n: saved_prefix + n[len(prefix) :] if n.startswith(prefix) else n for n in names}
    readers: dict[str, list[str]] = {}
    for name, stored in mapped.items():
        readers.setdefault(stored, []).append(name)
    clashes = {stored: found for stored, found in readers.items() if len(found) > 1}
    if clashes:
        stored, found = next(iter(clashes.items()))
        raise PipelineCheckpointError(
            f"it stores the network under the prefix {saved_prefix!r} and this model holds it under {prefix!r}, so"
            f" {found} would all read the stored entry {stored!r} ({len(clashes)} such entries). Rename the attribute"
            " outside the network, or load into a model that holds the network as the checkpoint's did."
        )
    return mapped


# ---------------------------------------------------------------------------------------------------- schedulers
def scheduler_source(manifest: Mapping[str, Any], pipeline_rank: int, pipeline_size: int) -> str:
    """The scheduler file pipeline rank ``pipeline_rank`` restores from.

    The same pipeline size restores each rank's own file. Another size has no rank-to-rank correspondence, so every
    rank restores pipeline rank 0's file; the caller checks that all saved files agree (schedulers that step in
    lockstep over identically built param groups do).
    """
    if manifest.get("pipeline_size") == pipeline_size:
        return scheduler_file(pipeline_rank)
    return scheduler_file(0)


def same_state(a: Any, b: Any) -> bool:
    """Structural equality of two state dicts (tensors compared by value)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return bool(a == b)
