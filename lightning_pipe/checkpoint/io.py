"""Where checkpoints are written and read: per-rank DCP shards, per-rank scheduler files, one trainer state file.

Every function here runs on every rank of the world (save and load are collective). Checks that can fail on some
ranks only are agreed on (``_agree``) before any collective that would otherwise wait forever for a rank that raised.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_pipe.checkpoint import format as fmt
from lightning_pipe.checkpoint import optim
from lightning_pipe.checkpoint.unpickle import load_pickled
from lightning_pipe.comm import collectives
from lightning_pipe.comm.dtensor import assign_whole_, place_like
from lightning_pipe.compat import torch as torch_compat
from lightning_pipe.errors import PipelineCheckpointError
from lightning_pipe.models import files_reading, kind_of
from lightning_pipe.models.files import LoadTarget, StateDictAdapter, load_mapped
from lightning_pipe.split.tied import tied_groups

#: The parameters' dtype under each Lightning precision (``-mixed``: float32 weights, the compute autocast).
PRECISION_DTYPES = {
    "64-true": torch.float64,
    "32-true": torch.float32,
    "bf16-mixed": torch.float32,
    "16-mixed": torch.float32,
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
}


@dataclass(frozen=True)
class Topology:
    """Where this process sits, as the checkpoint code needs it."""

    global_rank: int
    world_size: int
    pipeline_rank: int
    pipeline_size: int
    data_parallel_rank: int
    data_parallel_size: int
    stages_per_rank: int
    schedule: str
    #: this rank's pipeline process group (one rank for a one-process pipeline)
    pipeline_group: Any = None
    #: ``{name: first name}`` of tied parameters (held by several stages, stored once under their first name)
    aliases: Mapping[str, str] = field(default_factory=dict)
    #: whether parameters and optimizer state are sharded over the data-parallel ranks (FSDP DTensors)
    sharded: bool = False
    #: this process's place among those sharing its stages, and how many they are (tensor parallelism)
    tensor_parallel_rank: int = 0
    tensor_parallel_size: int = 1
    #: the group of every process of this rank's data-parallel replica (its pipeline without tensor parallelism):
    #: they write a replicated checkpoint together
    replica_group: Any = None
    #: the pipelined network's attribute in the module as a name prefix (``"model."``; ``""`` for the network itself)
    network_prefix: str = ""


# ---------------------------------------------------------------------------------------------------- collectives
def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``: checkpoints are saved and loaded by the whole world."""
    return collectives.all_gather_object(obj, collectives.world_group())


def agree(problems: Sequence[str], what: str) -> None:
    """Raise the same error on every rank if any rank found a problem, so no rank waits in a later collective."""
    everyone = _gather(list(problems))
    ranks_of: dict[str, list[int]] = {}
    for rank, found in enumerate(everyone):
        for problem in found:
            ranks_of.setdefault(problem, []).append(rank)
    if ranks_of:
        lines = [f"  - {problem} (rank {', '.join(map(str, ranks))})" for problem, ranks in ranks_of.items()]
        raise PipelineCheckpointError(f"{what}:\n" + "\n".join(lines))


def local_step(problems: list[str], fn: Any, *args: Any) -> Any:
    """Run a local step; an error becomes a problem to agree on instead of an exception on this rank alone."""
    try:
        return fn(*args)
    except (OSError, RuntimeError, ValueError, KeyError, EOFError) as err:
        problems.append(str(err) if isinstance(err, PipelineCheckpointError) else f"{type(err).__name__}: {err}")
        return None


# ---------------------------------------------------------------------------------------------------- state dicts
def model_state(module: nn.Module, aliases: Mapping[str, str] | None = None) -> dict[str, Any]:
    """This rank's model entries under the full model's names; a tied parameter under its first name only."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if not _holds_tensors(module):
        return {}  # a rank of pass-on stages only (a one-unit network); torch refuses an empty model state dict
    state = get_model_state_dict(module)
    for name, first in (aliases or {}).items():
        if name in state:
            value = state.pop(name)
            state.setdefault(first, value)
    return state


def _holds_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, aliases: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """This rank's optimizer state keyed by parameter name, flattened so every entry (hyperparameters included) has a
    key of its own: DCP keeps one copy of a key that several ranks hold, which would lose other stages' entries."""
    return optim.flatten(optimizer, optim.param_names(module, aliases))


def _as_local(module: nn.Module, loaded: Mapping[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """``loaded`` (first names) under the module's own state-dict names."""
    return {name: loaded[aliases.get(name, name)] for name in model_state(module) if aliases.get(name, name) in loaded}


def _shapes(prefix: str, state: Mapping[str, Any]) -> dict[str, tuple[int, ...] | None]:
    flat = torch_compat.flatten_state_dict({prefix.rstrip("."): dict(state)})
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in flat.items()}


def _stored(metadata: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype] | None]:
    """Every stored entry: ``(shape, dtype)`` of a tensor, ``None`` for a non-tensor."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        k: (tuple(v.size), v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
        for k, v in metadata.state_dict_metadata.items()
    }


def storage_ends(metadata: Any) -> list[tuple[str, int]]:
    return torch_compat.storage_extents(metadata)


# ---------------------------------------------------------------------------------------------------- load
def load(
    path: Path,
    topo: Topology,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    strict: bool,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load a directory checkpoint into this rank's ``module`` and ``optimizers`` (empty: weights only) and return
    Lightning's remaining checkpoint dict, with this rank's ``lr_schedulers`` when ``optimizers`` are given.

    Each rank reads only the entries of its own stages, whatever the pipeline layout at save time.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    path = Path(path)
    files = pretrained_files(path)
    if files is not None:
        raise PipelineCheckpointError(
            f"{str(path)!r} is a {files.title}: it holds weights only, no optimizer or loop state to"
            f" resume. Start a run from it with `PipelineParallelStrategy(init_weights={str(path)!r})`."
        )
    problems: list[str] = []
    # Names as the checkpoint stores them: the network under the saver's prefix (a Fabric or a Trainer checkpoint).
    rename = local_step(problems, _stored_names, path, module, topo)
    agree(problems, f"Cannot load checkpoint {str(path)!r}")
    weights = {rename[k]: v for k, v in model_state(module, topo.aliases).items()}
    expected = _shapes("state_dict", weights)
    names = {i: rename[n] for i, n in optim.param_names(module, topo.aliases).items()}
    found = local_step(problems, _validate, path, expected, optimizers, names, topo, weights_only)
    agree(problems, f"Cannot load checkpoint {str(path)!r}")
    manifest, stored, schedulers, rest = found
    used = [k for rank_keys in _gather(list(expected)) for k in rank_keys]
    # A tied parameter's other names: stored by checkpoints that kept them (one stage held every name), equal to it.
    used += [fmt.MODEL_PREFIX + rename[name] for name in topo.aliases]
    unexpected = fmt.unexpected_keys(stored, used)
    if strict and unexpected:
        raise PipelineCheckpointError(
            f"Checkpoint {str(path)!r} ({fmt.describe(manifest)}) holds weights the model does not have:"
            f" {fmt.format_keys(k[len(fmt.MODEL_PREFIX) :] for k in unexpected)}. It is from a different model; load"
            " it into the model that wrote it, or set `strict_loading = False` on the LightningModule."
        )
    state: dict[str, Any] = {"state_dict": weights}
    heads = _empty_group_heads(path, module, optimizers, topo)
    for i, optimizer in enumerate(optimizers):
        prefix = f"optimizer_{i}."
        own = {k[len(prefix) :]: v for k, v in stored.items() if k.startswith(prefix)}
        # DTensor placeholders for sharded state; the hyperparameters of groups without parameters here
        state[f"optimizer_{i}"] = optim.target(optimizer, names, own, heads[i])
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    except Exception as err:  # DCP wraps every rank's failure in CheckpointException, raised on all ranks
        raise PipelineCheckpointError(f"Reading checkpoint {str(path)!r} failed (corrupted shard?): {err}") from err
    loaded = _as_local(module, state["state_dict"], {k: rename[topo.aliases.get(k, k)] for k in rename})
    if _holds_tensors(module):
        set_model_state_dict(module, loaded, options=StateDictOptions(strict=strict))
    for i, optimizer in enumerate(optimizers):
        optimizer.load_state_dict(optim.unflatten(optimizer, names, state[f"optimizer_{i}"], heads[i]))
    if optimizers and schedulers is not None:
        rest["lr_schedulers"] = schedulers
    if optimizers:
        rest[RESUME_POINT] = resume_point(path, manifest, topo)
    return rest


#: Key of this rank's resume point in what :func:`load` returns (``None`` when the checkpoint has none for it).
RESUME_POINT = "lightning_pipe_resume_point"


def _empty_group_heads(
    path: Path, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], topo: Topology
) -> list[dict[int, str]]:
    """Per optimizer, its param groups without parameters on this rank (a rank of pass-on stages has only such):
    the stored name of a parameter each holds in the full model (recorded before the split), whose hyperparameters
    are the group's, so a resumed group's learning rate is the saved one, as on the ranks that hold the parameters."""
    recorded = optim.recorded_param_groups(module) or []
    saved_prefix = fmt.read_manifest(path).get(fmt.NETWORK_PREFIX, topo.network_prefix)
    heads: list[dict[int, str]] = []
    for i, optimizer in enumerate(optimizers):
        groups = recorded[i] if i < len(recorded) else []
        first = {
            g: groups[g][0]
            for g, group in enumerate(optimizer.param_groups)
            if not group["params"] and g < len(groups) and groups[g] and groups[g][0] is not None
        }
        stored = fmt.stored_names(first.values(), topo.network_prefix, saved_prefix)
        heads.append({g: stored[name] for g, name in first.items()})
    return heads


def _stored_names(path: Path, module: nn.Module, topo: Topology) -> dict[str, str]:
    """Each of the module's state-dict names (tied names included) under its name in checkpoint ``path``."""
    saved_prefix = fmt.read_manifest(path).get(fmt.NETWORK_PREFIX, topo.network_prefix)
    local = [*model_state(module), *topo.aliases, *topo.aliases.values()]
    return fmt.stored_names(local, topo.network_prefix, saved_prefix)


def resume_point(path: Path, manifest: Mapping[str, Any], topo: Topology) -> dict[str, Any] | None:
    """This rank's resume point in checkpoint ``path``: only when it was saved by the same layout (a rank's random
    streams belong to its stages and replica), and written by a version that keeps one."""
    same_layout = (
        manifest.get("pipeline_size") == topo.pipeline_size
        and manifest.get("data_parallel_size") == topo.data_parallel_size
        and manifest.get("stages_per_rank") == topo.stages_per_rank
    )
    file = path / fmt.resume_file(topo.global_rank)
    if not same_layout or fmt.resume_file(topo.global_rank) not in manifest.get(fmt.RESUME_FILES, []):
        return None
    return torch.load(file, map_location="cpu", weights_only=True)


def _validate(
    path: Path,
    expected: Mapping[str, tuple[int, ...] | None],
    optimizers: Sequence[torch.optim.Optimizer],
    names: Mapping[int, str],
    topo: Topology,
    weights_only: bool | None,
) -> tuple[dict[str, Any], dict[str, Any], list[Any] | None, dict[str, Any]]:
    import torch.distributed.checkpoint as dcp

    manifest = fmt.read_manifest(path)
    metadata = None
    if (path / fmt.DCP_METADATA).is_file():
        metadata = dcp.FileSystemReader(path).read_metadata()
    problems = fmt.missing_files(path, manifest, storage_ends(metadata) if metadata is not None else [])
    if problems:
        raise PipelineCheckpointError(f"it is incomplete or corrupted: {'; '.join(problems)}")
    assert metadata is not None
    if optimizers and manifest["optimizers"] != len(optimizers):
        raise PipelineCheckpointError(
            f"it holds the state of {manifest['optimizers']} optimizer(s) but `configure_optimizers` returned"
            f" {len(optimizers)}"
            + (
                " (it was saved with weights only). To start training from its weights, pass"
                f" `PipelineParallelStrategy(init_weights={str(path)!r})` instead of `ckpt_path`"
                if manifest["optimizers"] == 0
                else ""
            )
        )
    stored = _stored(metadata)
    problems = fmt.key_problems(expected, {k: v[0] if v else None for k, v in stored.items()})
    for i, optimizer in enumerate(optimizers):
        prefix = f"optimizer_{i}."
        missing = optim.missing_params(optimizer, names, [k[len(prefix) :] for k in stored if k.startswith(prefix)])
        if missing:
            problems.append(optim.describe_missing(missing, i))
    if problems:
        raise PipelineCheckpointError(
            f"it does not match this rank's stages ({fmt.describe(manifest)}): {'; '.join(problems)}"
        )
    schedulers = (
        _schedulers(path, manifest, topo, weights_only) if optimizers and manifest["lr_scheduler_files"] else None
    )
    fix = "pass `weights_only=False` to `trainer.fit`/`validate`/`test`/`predict` with this `ckpt_path`"
    return manifest, stored, schedulers, load_trainer_state(path, weights_only, fix)


def load_trainer_state(path: Path, weights_only: bool | None, fix: str) -> Any:
    """The directory's ``trainer.pt``; where torch's weights-only unpickler refuses an object in it, the error says
    which and names ``fix`` (how the caller loads a trusted file)."""
    file = path / fmt.TRAINER_STATE
    try:
        return load_pickled(file, weights_only)
    except pickle.UnpicklingError as err:
        found = [line.strip() for line in str(err).splitlines() if "WeightsUnpickler error" in line]
        raise PipelineCheckpointError(
            f"{str(file)!r} holds pickled objects that torch's weights-only loader refuses"
            f" ({found[0] if found else type(err).__name__}); a network kept by `save_hyperparameters()` is the usual"
            f" one. If you trust the checkpoint, {fix}; or keep the object out of the hyperparameters"
            " (`self.save_hyperparameters(ignore=['net'])`)."
        ) from err


def _schedulers(path: Path, manifest: Mapping[str, Any], topo: Topology, weights_only: bool | None) -> list[Any]:
    source = fmt.scheduler_source(manifest, topo.pipeline_rank, topo.pipeline_size)
    chosen = load_pickled(path / source, weights_only)
    if source == fmt.scheduler_file(topo.pipeline_rank) and manifest["pipeline_size"] == topo.pipeline_size:
        return chosen
    for other in manifest["lr_scheduler_files"]:
        if not fmt.same_state(chosen, load_pickled(path / other, weights_only)):
            raise PipelineCheckpointError(
                f"its LR scheduler states differ between pipeline ranks ({source} vs {other}), and with"
                f" pipeline_size={topo.pipeline_size} instead of {manifest['pipeline_size']} no rank's state can be"
                " assigned to the new ranks. Resume with the pipeline size it was saved with."
            )
    return chosen


# ---------------------------------------------------------------------------------------------------- single files
def pretrained_files(path: Path) -> StateDictAdapter | None:
    """The files of the model kind whose directories ``path`` is one of (a Hugging Face model directory, ...);
    ``None`` for a lightning-pipe checkpoint (its manifest), a file, or a directory no kind reads."""
    path = Path(path)
    if not path.is_dir() or (path / fmt.MANIFEST).exists():
        return None
    return files_reading(path)


def load_weights(
    source: Path,
    topo: Topology,
    module: nn.Module,
    *,
    network_prefix: str,
    strict: bool,
    weights_only: bool | None = True,
    precision: str | None = None,
) -> dict[str, Any]:
    """Load initial weights for this rank's stages from a single-file ``.ckpt``, a plain ``state_dict`` file, a
    directory checkpoint or a model kind's directory (a Hugging Face model directory: :func:`load_pretrained`, whose
    weights take the dtype of the Trainer's ``precision``). A file is memory-mapped: a rank reads only its own
    stages' tensors from it.

    Returns what else a single-file Lightning checkpoint holds (``{}`` for a plain state dict or a directory).
    """
    source = Path(source)
    files = pretrained_files(source)
    if files is not None:
        dtype = PRECISION_DTYPES.get(precision) if precision is not None else None
        load_pretrained(files, source, topo, module, network_prefix=network_prefix, strict=strict, dtype=dtype)
        return {}
    if source.is_dir():
        load(source, topo, module, [], strict=strict)
        return {}
    weights, rest = _read_file(source, weights_only)
    _copy_weights(source, weights, module, network_prefix=network_prefix, strict=strict)
    return rest


def load_hf(source: Path, topo: Topology, module: nn.Module, **options: Any) -> int:
    """:func:`load_pretrained` of the Hugging Face model directory ``source`` (``options``: its keyword arguments)."""
    from lightning_pipe.models.huggingface.files import HuggingFaceFiles

    return load_pretrained(HuggingFaceFiles(), source, topo, module, **options)


def tie_groups(module: nn.Module, aliases: Mapping[str, str]) -> list[list[str]]:
    """The names of each parameter tied in ``module`` and of each tied across stages (``aliases``: ``{name: first
    name}``), the first the one transformers keeps."""
    across: dict[str, list[str]] = {}
    for name, first in aliases.items():
        across.setdefault(first, [first]).append(name)
    return [*map(list, tied_groups(module)), *across.values()]


def load_pretrained(
    files: StateDictAdapter,
    source: Path,
    topo: Topology,
    module: nn.Module,
    *,
    network_prefix: str,
    strict: bool,
    dtype: torch.dtype | None = None,
) -> int:
    """Load this rank's stages from ``source``, a directory of the model kind whose ``files`` read it; returns the
    bytes this rank read.

    ``dtype``: the floating-point dtype the network's parameters are cast to first (the Trainer's precision:
    ``from_config`` builds a network in the dtype its ``config.json`` names, bfloat16 for most published models).

    Each rank reads only its own stages' tensors (``files.plan_load``); a stored tensor is read once however many of
    the rank's parameters it fills. The same error is raised on every rank: another model type, shapes that differ,
    and (``strict``) the model's keys the directory lacks and stored keys no rank loads; without ``strict`` those
    are a warning and missing weights keep the model's own initialisation.
    """
    network = module.get_submodule(network_prefix[:-1]) if network_prefix else module
    tensors = [*network.parameters(), *network.buffers()]
    if dtype is not None and any(t.is_floating_point() and t.dtype != dtype for t in tensors):
        # Only when needed: `to` swaps DTensor parameters (tensor parallelism), which fails once autograd holds them.
        network.to(dtype)
    problems: list[str] = []
    target = LoadTarget(
        model_state(module), network, kind_of(network), network_prefix, tie_groups(module, topo.aliases)
    )
    plan = local_step(problems, files.plan_load, Path(source), target)
    agree(problems, f"Cannot load the {files.title} {str(source)!r}")
    # What every rank reads, leaves unread on purpose and misses: the same verdict on every rank.
    found = _gather((sorted(plan.targets), sorted(plan.ignorable), plan.missing, plan.new_head))
    used = {name for read, ignorable, _, _ in found for name in (*read, *ignorable)}
    missing = sorted({key for _, _, keys, _ in found for key in keys})
    unexpected = sorted(plan.stored_names - used)
    new_head = sorted({key for *_, keys in found for key in keys})
    if new_head and topo.global_rank == 0:
        warnings.warn(files.new_head_message(Path(source), network, plan, new_head), UserWarning, stacklevel=2)
    if missing or unexpected:
        message = files.mismatch_message(Path(source), missing, unexpected, strict)
        if strict:
            raise PipelineCheckpointError(message)
        if topo.global_rank == 0:
            warnings.warn(message, UserWarning, stacklevel=2)
    read = local_step(problems, files.copy_into, plan, assign_whole_)
    agree(problems, f"Reading the {files.title} {str(source)!r} failed")
    return read


def resume_from_file(
    source: Path,
    topo: Topology,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    param_groups: optim.ParamGroups | None,
    *,
    strict: bool,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Resume ``fit`` from a single-file Lightning checkpoint written on one device (or by DDP): this rank's weights
    and optimizer states, and Lightning's remaining checkpoint dict (LR schedulers, loops, callbacks, ...).

    The file stores optimizer state by parameter position; ``param_groups`` (:func:`optim.full_param_groups` of the
    full model, recorded before the split) names the positions. The file is memory-mapped: a rank reads only its own
    stages' tensors.
    """
    source = Path(source)
    weights, rest = _read_file(source, weights_only)
    problems: list[str] = []
    states = local_step(problems, _local_optimizer_states, source, rest, module, optimizers, param_groups, topo.aliases)
    agree(problems, f"Cannot resume `fit` from {str(source)!r}")
    _copy_weights(source, weights, module, network_prefix="", strict=strict)
    for optimizer, state in zip(optimizers, states):
        optimizer.load_state_dict(_laid_out_like_parameters(optimizer, state))
    rest.pop("optimizer_states", None)
    return rest


def _laid_out_like_parameters(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (an optimizer state dict of whole tensors, from one device) with each entry shaped like its parameter
    laid out as the parameter is (this rank's slice of a tensor-parallel or FSDP DTensor)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    placed = {}
    for index, entries in state["state"].items():
        p = params[index]
        placed[index] = {
            key: place_like(value, p) if isinstance(value, torch.Tensor) and value.shape == p.shape else value
            for key, value in entries.items()
        }
    return {**state, "state": placed}


def _read_file(source: Path, weights_only: bool | None) -> tuple[dict[str, Any], dict[str, Any]]:
    problems: list[str] = []
    found = local_step(problems, lambda: _split_weights(_mmap(source, weights_only)))
    agree(problems, f"Cannot read weights from {str(source)!r}")
    return found


def _copy_weights(
    source: Path, weights: Mapping[str, Any], module: nn.Module, *, network_prefix: str, strict: bool
) -> None:
    local = model_state(module)
    names = fmt.match_weight_keys(local, weights, network_prefix)
    expected = {names[k]: tuple(v.shape) for k, v in local.items() if isinstance(v, torch.Tensor)}
    stored = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in weights.items()}
    problems = fmt.key_problems(expected, stored)
    agree(problems, f"The weights in {str(source)!r} do not match this rank's stages")
    used = {k for rank_keys in _gather(sorted(expected)) for k in rank_keys}
    unexpected = sorted(set(weights) - used)
    if strict and unexpected:
        raise PipelineCheckpointError(
            f"{str(source)!r} holds weights the model does not have: {fmt.format_keys(unexpected)}. Check that it"
            " belongs to this model, or set `strict_loading = False` on the LightningModule to ignore them."
        )
    for key, tensor in local.items():
        assign_whole_(tensor, weights[names[key]])  # this rank's slice of a DTensor


def _local_optimizer_states(
    source: Path,
    rest: Mapping[str, Any],
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    param_groups: optim.ParamGroups | None,
    aliases: Mapping[str, str],
) -> list[dict[str, Any]]:
    """This rank's part of each optimizer state in a single-device checkpoint, in the form its optimizer loads."""
    saved = rest.get("optimizer_states")
    if saved is None or (optimizers and not saved):
        raise PipelineCheckpointError(
            f"`ckpt_path={str(source)!r}` is a single-file checkpoint without optimizer state (saved with weights"
            " only, or consolidated without `--with-optimizer`), so `fit` cannot resume from it. To train from its"
            f" weights, pass `PipelineParallelStrategy(init_weights={str(source)!r})` instead of `ckpt_path`."
        )
    if len(saved) != len(optimizers):
        raise PipelineCheckpointError(
            f"it holds the state of {len(saved)} optimizer(s) but `configure_optimizers` returned {len(optimizers)}"
        )
    if param_groups is None or len(param_groups) != len(optimizers):
        raise PipelineCheckpointError(
            "the single-device parameter order of this LightningModule's optimizers was not recorded. It is recorded"
            " when `trainer.fit` splits the model, by calling `configure_optimizers` on the full model; this module"
            " was split by an earlier `validate`, `test` or `predict`, or that call failed (see the warning). Resume"
            " with a new LightningModule instance, passing `ckpt_path` to its first `trainer.fit`."
        )
    names = optim.param_names(module, aliases)
    return [
        optim.localize(state, groups, optim.ordered_names(optimizer, names), i)
        for i, (state, groups, optimizer) in enumerate(zip(saved, param_groups, optimizers))
    ]


def _mmap(source: Path, weights_only: bool | None = True) -> Any:
    if not source.exists():
        raise FileNotFoundError(f"{str(source)!r} does not exist")
    return load_mapped(source, weights_only)


def _split_weights(loaded: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        rest = {k: v for k, v in loaded.items() if k != "state_dict"}
        return dict(loaded["state_dict"]), rest
    if isinstance(loaded, Mapping) and all(isinstance(v, torch.Tensor) for v in loaded.values()):
        return dict(loaded), {}
    raise PipelineCheckpointError(
        "expected a Lightning checkpoint (a dict with a 'state_dict') or a plain state dict (names to tensors), got"
        f" {type(loaded).__name__}"
    )


def load_in_memory(
    checkpoint: Mapping[str, Any], topo: Topology, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]
) -> None:
    """Load a checkpoint dict this rank's layout dumped (``state_dict`` and ``optimizer_states`` as
    :func:`model_state` and :func:`optimizer_state` make them: an in-memory snapshot) into ``module`` and
    ``optimizers``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if _holds_tensors(module):
        loaded = _as_local(module, checkpoint["state_dict"], topo.aliases)
        set_model_state_dict(module, loaded, options=StateDictOptions(strict=True))
    names = optim.param_names(module, topo.aliases)
    for optimizer, flat in zip(optimizers, checkpoint["optimizer_states"]):
        optimizer.load_state_dict(optim.unflatten(optimizer, names, flat))
