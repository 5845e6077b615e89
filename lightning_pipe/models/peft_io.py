"""A PEFT model's files: its adapters read from an adapter directory (``PipelineParallelStrategy(init_adapter=DIR)``
continues a LoRA, LoHa, ... fine-tune, each rank reading only its own stages' adapter tensors), and a checkpoint of
it exported as peft writes it (``export-hf --adapter`` or ``--merge``).

An adapter directory is what ``PeftModel.save_pretrained`` writes (and ``export-hf --adapter``)::

    adapter_config.json          the adapter's peft config
    adapter_model.safetensors    its tensors (``adapter_model.bin`` from older peft), by peft's saved names
    <name>/...                   each further adapter, in a sub-directory named after it

The adapter ``default`` is the directory itself and any other adapter ``<name>`` its sub-directory, as peft saves them;
a model with one adapter of another name reads the directory itself when it has no such sub-directory. peft saves a
tensor without the adapter's name (``q_proj.lora_A.default.weight`` as ``q_proj.lora_A.weight``, a
``modules_to_save`` copy ``norm.modules_to_save.default.weight`` as ``norm.weight``); the network is the PEFT model
``get_peft_model`` built in ``configure_model``, whose config must agree with the saved one on every field that
shapes or scales the adapters (:data:`COMPARED`). The base weights are not in an adapter directory: they come from
``init_weights``. :func:`plan_adapters` is local to one process: :func:`lightning_pipe.checkpoint.adapters.
load_adapters` runs it on every rank and agrees on the errors.

The checkpoint records the wrapped transformers model's config and the peft configs (``PeftKind.record``). Both
exports (:func:`export`) build that PEFT model on the meta device, so names, adapters and ``modules_to_save`` are
peft's own:

- ``--adapter``: only the trainable tensors (the adapters and the ``modules_to_save`` copies) are read from the
  checkpoint; ``PeftModel.save_pretrained`` writes ``adapter_config.json`` and ``adapter_model.safetensors`` (one
  sub-directory per further adapter, as peft does), for ``PeftModel.from_pretrained(base, OUT_DIR)``. The base
  weights are not read: memory is the adapters' size.
- ``--merge``: every tensor is read (the whole model in memory once, in the checkpoint's dtype), the adapters are
  merged into the base layers (``merge_and_unload``) and transformers' ``save_pretrained`` writes the merged model for
  ``AutoModel...from_pretrained(OUT_DIR)``, in shards of at most ``max_shard_size``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_pipe.errors import PipelineCheckpointError
from lightning_pipe.models.files import CheckpointEntries, LoadPlan, format_keys
from lightning_pipe.models.huggingface import directory as hf
from lightning_pipe.models.huggingface.export import meta_model

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_SAFETENSORS = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"
#: the fields of a peft config that must agree with the adapter directory's: what shapes the adapters, where they
#: sit and how they scale (dropout, initialisation and the base model's name may differ)
COMPARED = (
    "peft_type",
    "r",
    "lora_alpha",
    "alpha",
    "target_modules",
    "exclude_modules",
    "modules_to_save",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "use_rslora",
    "use_dora",
    "bias",
    "lora_bias",
    "fan_in_fan_out",
    "use_effective_conv2d",
    "decompose_both",
    "decompose_factor",
    "layer_replication",
    "target_parameters",
)
#: fields whose list is a set (peft saves a set as a list in any order)
_SETS = ("target_modules", "exclude_modules", "modules_to_save", "layers_to_transform")
#: the manifest record's entry a PEFT model adds (``{"prefix": ..., "configs": {adapter name: peft config dict}}``)
PEFT = "peft"
#: bytes read from the checkpoint at once
READ_BYTES = 16 * 2**20


def where(path: Path) -> str:
    """The adapter file of the adapter directory ``path``, for messages."""
    return str(path / ADAPTER_SAFETENSORS if (path / ADAPTER_SAFETENSORS).is_file() else path / ADAPTER_BIN)


def plan_adapters(source: Path, network: nn.Module) -> list[LoadPlan]:
    """One load plan per adapter of the PEFT model ``network``: its directory's stored names and this rank's tensors
    they fill."""
    if not source.is_dir():
        raise PipelineCheckpointError(f"{str(source)!r} is not a directory (an adapter directory of peft's)")
    configs = dict(network.peft_config)
    prefix = network.base_model.prefix
    found = {name: adapter_directory(source, name, len(configs)) for name in configs}
    extra = sorted(
        p.name for p in source.iterdir() if (p / ADAPTER_CONFIG).is_file() and p.name not in found and p != source
    )
    if extra:
        raise PipelineCheckpointError(
            f"it holds adapters {extra} (sub-directories with an {ADAPTER_CONFIG}) that the model does not have (its"
            f" adapters: {sorted(configs)}). Add them in `configure_model` (`model.add_adapter(name, config)`), or"
            " pass the directory of one adapter"
        )
    plans = []
    for adapter, path in found.items():
        check_config(path, adapter, configs[adapter])
        plans.append(_adapter_plan(path, network, adapter, prefix))
    return plans


def adapter_directory(source: Path, adapter: str, adapters: int) -> Path:
    """Where peft saves the adapter ``adapter``: ``source`` for ``default``, its sub-directory of that name for
    another; ``source`` for the only adapter of a model when it has no such sub-directory."""
    path = source if adapter == "default" else source / adapter
    if adapter != "default" and adapters == 1 and not (path / ADAPTER_CONFIG).is_file():
        path = source
    if not (path / ADAPTER_CONFIG).is_file():
        raise PipelineCheckpointError(
            f"the model's adapter {adapter!r} is not in it: {str(path / ADAPTER_CONFIG)!r} does not exist (peft"
            " saves the adapter 'default' in the directory itself and another adapter in a sub-directory of its"
            " name). Pass the directory `PeftModel.save_pretrained` or `export-hf --adapter` wrote"
        )
    if not any((path / name).is_file() for name in (ADAPTER_SAFETENSORS, ADAPTER_BIN)):
        raise PipelineCheckpointError(
            f"{str(path)!r} has an {ADAPTER_CONFIG} but no {ADAPTER_SAFETENSORS} (nor {ADAPTER_BIN}): the copy is"
            " incomplete"
        )
    return path


def check_config(path: Path, adapter: str, config: Any) -> None:
    """Refuse, by field, a peft config that differs from the adapter directory's on a :data:`COMPARED` field."""
    try:
        saved = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise PipelineCheckpointError(f"{str(path / ADAPTER_CONFIG)!r} cannot be read as JSON ({err})") from err
    model = json.loads(json.dumps(config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
    wrong = [
        f"{field} is {_normal(field, saved[field])!r} in {ADAPTER_CONFIG} but {_normal(field, model[field])!r} in"
        " the model's"
        for field in COMPARED
        if field in saved and field in model and _normal(field, saved[field]) != _normal(field, model[field])
    ]
    if wrong:
        raise PipelineCheckpointError(
            f"the model's adapter {adapter!r} ({type(config).__name__}) was not built with the config it was saved"
            f" with ({str(path)!r}): " + "; ".join(wrong) + ". Build it with the saved config:"
            f" `peft.get_peft_model(model, peft.PeftConfig.from_pretrained({str(path)!r}))`"
        )


def _normal(field: str, value: Any) -> Any:
    if field == "peft_type" and isinstance(value, str):
        return value.upper()
    if field in _SETS and isinstance(value, list):
        return sorted(value, key=repr)
    return value


def saved_name(name: str, adapter: str, prefix: str) -> str | None:
    """The name peft saves the network's tensor ``name`` under when it belongs to ``adapter`` (the adapter's name
    left out; a ``modules_to_save`` copy under its module's name); ``None`` for any other tensor."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        if parts[i] != adapter:
            continue
        if parts[i - 1] == "modules_to_save":
            return ".".join(parts[: i - 1] + parts[i + 1 :])
        if parts[i - 1].startswith(prefix):
            return ".".join(parts[:i] + parts[i + 1 :])
    return None


def _adapter_plan(path: Path, network: nn.Module, adapter: str, prefix: str) -> LoadPlan:
    kind = "safetensors" if (path / ADAPTER_SAFETENSORS).is_file() else "bin"
    file = ADAPTER_SAFETENSORS if kind == "safetensors" else ADAPTER_BIN
    stored = hf.stored_names(path / file, kind)
    directory = hf.Directory(path, kind, dict.fromkeys(stored, file), None)
    local: dict[str, torch.Tensor] = {}
    for name, tensor in network.state_dict(keep_vars=True).items():
        saved = saved_name(name, adapter, prefix)
        if saved is not None:
            local[saved] = tensor
    missing = sorted(n for n in local if n not in directory.files)
    if missing:
        raise PipelineCheckpointError(
            f"the model's adapter {adapter!r} has {format_keys(missing)}, which {where(path)} does not hold."
            " Build the PEFT model with the adapter directory's config (`peft.PeftConfig.from_pretrained(path)`)"
        )
    shapes = hf.stored_shapes(directory, local)
    wrong = [
        f"{n!r} is {list(shapes[n])} there but {list(t.shape)} in the model"
        for n, t in local.items()
        if shapes[n] != tuple(t.shape)
    ]
    if wrong:
        raise PipelineCheckpointError(f"shape mismatch in {where(path)}: " + "; ".join(wrong[:4]))
    return LoadPlan(directory, {n: [t] for n, t in local.items()}, where=where(path))


# ---------------------------------------------------------------------------------------------------- export
def export(
    entries: CheckpointEntries,
    out: Path,
    hf_config: Any,
    generation: Any,
    prefix: str,
    *,
    merge: bool,
    max_shard_size: int | str,
    dtype: torch.dtype | None,
) -> None:
    """Write the PEFT checkpoint ``entries`` into the empty directory ``out``: an adapter directory (``merge=False``)
    or a merged model directory.

    ``entries.record`` is the kind's record (with its :data:`PEFT` entry); ``hf_config``/``generation``: the
    wrapped model's configs; ``prefix``: the LightningModule's attribute holding the PEFT model, as a name prefix;
    ``dtype``: write floating-point tensors in it (``None``: as stored).
    """
    src = entries.path
    assert entries.record is not None
    network = _meta_peft_model(hf_config, entries.record[PEFT]["configs"], src)
    names = [n for n, p in network.named_parameters() if p.requires_grad] if not merge else None
    tensors = _read(entries, network, prefix, names)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    missing, _ = network.load_state_dict(tensors, strict=False, assign=True)
    if not merge:
        network.save_pretrained(out, safe_serialization=True)
        return
    if missing:  # state-dict names only: a non-persistent buffer is not missing
        raise PipelineCheckpointError(
            f"Cannot merge {str(src)!r}: the checkpoint lacks {format_keys(missing)} of the recorded"
            f" PEFT model (under {prefix!r}). Pass the attribute that holds it (`--attribute`)."
        )
    _tie(network)
    merged = network.merge_and_unload()
    merged.save_pretrained(out, max_shard_size=max_shard_size, safe_serialization=True)
    if generation is not None:
        generation.save_pretrained(out)


def refuse_plain_export(src: Path) -> PipelineCheckpointError:
    """The error for ``export-hf`` of a PEFT checkpoint without ``--adapter`` or ``--merge``."""
    return PipelineCheckpointError(
        f"{str(src)!r} is a checkpoint of a PEFT model (its base weights are stored under peft's names, beside the"
        " adapters): pass `--adapter` (`adapter=True`) to write adapter_model.safetensors and adapter_config.json for"
        " `PeftModel.from_pretrained(base, OUT)`, or `--merge` (`merge=True`) to write the model with the adapters"
        " merged in, for `from_pretrained(OUT)`."
    )


def refuse_not_peft(src: Path, flag: str) -> PipelineCheckpointError:
    """The error for ``--adapter``/``--merge`` on a checkpoint of a network that is not a PEFT model."""
    return PipelineCheckpointError(
        f"`{flag}` exports a PEFT model's adapters, but {str(src)!r} records no PEFT model (its network was not"
        f" wrapped by `peft.get_peft_model`, or an earlier lightning-pipe saved it). Leave out `{flag}` to export the"
        " whole model."
    )


def _peft() -> Any:
    try:
        import peft
    except ImportError as err:
        raise PipelineCheckpointError("Exporting a PEFT model's checkpoint needs peft: `pip install peft`.") from err
    return peft


def _meta_peft_model(hf_config: Any, configs: Mapping[str, Mapping[str, Any]], src: Path) -> Any:
    """The recorded PEFT model around the config's transformers model, on the meta device."""
    peft = _peft()
    base = meta_model(hf_config, src)
    adapters = list(configs.items())
    with torch.device("meta"):
        network = peft.get_peft_model(base, peft.PeftConfig.from_peft_type(**adapters[0][1]), adapters[0][0])
        for adapter, values in adapters[1:]:
            network.add_adapter(adapter, peft.PeftConfig.from_peft_type(**values))
    return network


def _read(
    entries: CheckpointEntries, network: torch.nn.Module, prefix: str, names: list[str] | None
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of ``names`` (every stored one of the PEFT model when ``None``), by the PEFT model's
    names; a tied parameter's other names are read from the one stored."""
    stored, aliases = entries.names, entries.aliases
    wanted = names if names is not None else list(network.state_dict())
    keys: dict[str, str] = {}
    for name in wanted:
        key = prefix + name
        key = key if key in stored else aliases.get(key, key)
        if key in stored:
            keys[name] = key
    if names is not None:
        lacking = [n for n in names if n not in keys]
        if lacking:
            raise PipelineCheckpointError(
                f"Cannot export the adapters of {str(entries.path)!r}: it lacks {format_keys(lacking)} of the recorded"
                f" PEFT model (under {prefix!r}). Pass the attribute that holds it (`--attribute`)."
            )
    values: dict[str, torch.Tensor] = {}
    for chunk in entries.read(sorted(set(keys.values())), READ_BYTES):
        values.update(chunk)
    return {name: values[key] for name, key in keys.items()}


def _tie(network: Any) -> None:
    """Tie the wrapped model's embeddings again: ``load_state_dict(assign=True)`` set each name's tensor apart."""
    model = network.get_base_model()
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()
