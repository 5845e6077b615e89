"""A PEFT model's adapters from an adapter directory: ``PipelineParallelStrategy(init_adapter=DIR)`` continues a
LoRA (LoHa, ...) fine-tune, each rank reading only its own stages' adapter tensors.

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
``init_weights``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_pipe.checkpoint import format as fmt
from lightning_pipe.checkpoint import huggingface as hf
from lightning_pipe.checkpoint.io import Topology, agree, local_step
from lightning_pipe.comm import collectives
from lightning_pipe.errors import PipelineCheckpointError, PipelineConfigError
from lightning_pipe.models.peft import is_peft_model

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


def load_adapters(source: Path, topo: Topology, module: nn.Module, *, network_prefix: str) -> int:
    """Load this rank's adapter tensors of the PEFT network (``module``'s ``network_prefix`` attribute) from the
    adapter directory ``source``; returns the bytes this rank read. Every rank raises the same error: a network that
    is not a PEFT model, a missing adapter or file, a config that differs, a tensor missing, left over or of another
    shape."""
    network = module.get_submodule(network_prefix[:-1]) if network_prefix else module
    if not is_peft_model(network):
        raise PipelineConfigError(
            f"`init_adapter={str(source)!r}` loads PEFT adapters, but the network ({type(network).__name__}) is not a"
            " PEFT model. Wrap it in `configure_model`: `self.model = peft.get_peft_model(model, LoraConfig(...))`,"
            " or leave out `init_adapter`."
        )
    problems: list[str] = []
    plans = local_step(problems, _plan, Path(source), network)
    agree(problems, f"Cannot load the adapter directory {str(source)!r}")
    # A stored tensor no rank's stages read: the adapter directory does not match the model.
    read = collectives.all_gather_object([sorted(p.targets) for p in plans], collectives.world_group())
    for i, plan in enumerate(plans):
        unread = set(plan.directory.files) - {name for rank in read for name in rank[i]}
        if unread:
            problems.append(
                f"{_where(plan.directory.path)} holds {fmt.format_keys(sorted(unread))}, which the model's adapter"
                " does not have. Build the PEFT model with the adapter directory's config"
                " (`peft.PeftConfig.from_pretrained(path)`)"
            )
    agree(problems, f"Cannot load the adapter directory {str(source)!r}")
    nbytes = [local_step(problems, hf.copy_into, plan) for plan in plans]
    agree(problems, f"Reading the adapter directory {str(source)!r} failed")
    return sum(nbytes)


def _where(path: Path) -> str:
    return str(path / ADAPTER_SAFETENSORS if (path / ADAPTER_SAFETENSORS).is_file() else path / ADAPTER_BIN)


def _plan(source: Path, network: nn.Module) -> list[hf.LoadPlan]:
    """One load plan per adapter of the network: its directory's stored names and this rank's tensors they fill."""
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


def _adapter_plan(path: Path, network: nn.Module, adapter: str, prefix: str) -> hf.LoadPlan:
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
            f"the model's adapter {adapter!r} has {fmt.format_keys(missing)}, which {_where(path)} does not hold."
            " Build the PEFT model with the adapter directory's config (`peft.PeftConfig.from_pretrained(path)`)"
        )
    shapes = hf.stored_shapes(directory, local)
    wrong = [
        f"{n!r} is {list(shapes[n])} there but {list(t.shape)} in the model"
        for n, t in local.items()
        if shapes[n] != tuple(t.shape)
    ]
    if wrong:
        raise PipelineCheckpointError(f"shape mismatch in {_where(path)}: " + "; ".join(wrong[:4]))
    return hf.LoadPlan(directory, {n: [t] for n, t in local.items()}, [], set())
