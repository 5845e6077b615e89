"""Export a lightning-pipe checkpoint of a PEFT model (``get_peft_model`` in ``configure_model``) as peft writes it:
``python -m lightning_pipe.checkpoint export-hf CKPT_DIR OUT_DIR --adapter`` or ``--merge``.

The checkpoint records the wrapped transformers model's config and the peft configs (``PeftKind.record``). Both
exports build that PEFT model on the meta device, so names, adapters and ``modules_to_save`` are peft's own:

- ``--adapter``: only the trainable tensors (the adapters and the ``modules_to_save`` copies) are read from the
  checkpoint; ``PeftModel.save_pretrained`` writes ``adapter_config.json`` and ``adapter_model.safetensors`` (one
  sub-directory per further adapter, as peft does), for ``PeftModel.from_pretrained(base, OUT_DIR)``. The base
  weights are not read: memory is the adapters' size.
- ``--merge``: every tensor is read (the whole model in memory once, in the checkpoint's dtype), the adapters are
  merged into the base layers (``merge_and_unload``) and transformers' ``save_pretrained`` writes the merged model for
  ``AutoModel...from_pretrained(OUT_DIR)``, in shards of at most ``max_shard_size``.

The directory appears complete or not at all.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.checkpoint import convert
from lightning_pipe.checkpoint import format as fmt
from lightning_pipe.checkpoint.save import replace_directory
from lightning_pipe.errors import PipelineCheckpointError

#: the manifest record's entry a PEFT model adds (``{"prefix": ..., "configs": {adapter name: peft config dict}}``)
PEFT = "peft"
#: bytes read from the checkpoint at once
READ_BYTES = 16 * 2**20


def export(
    src: Path,
    dst: Path,
    record: Mapping[str, Any],
    hf_config: Any,
    generation: Any,
    prefix: str,
    *,
    merge: bool,
    max_shard_size: int | str,
    dtype: torch.dtype | None,
) -> Path:
    """Write the PEFT checkpoint ``src`` as an adapter directory (``merge=False``) or as a merged model directory.

    ``record``: the manifest's network record (with its :data:`PEFT` entry); ``hf_config``/``generation``: the
    wrapped model's configs; ``prefix``: the LightningModule's attribute holding the PEFT model, as a name prefix;
    ``dtype``: write floating-point tensors in it (``None``: as stored). ``dst`` must not exist.
    """
    network = _meta_peft_model(hf_config, record[PEFT]["configs"], src)
    stored = _stored_keys(src)
    aliases = fmt.read_manifest(src).get(fmt.ALIASES, {})
    names = [n for n, p in network.named_parameters() if p.requires_grad] if not merge else None
    tensors = _read(src, network, prefix, stored, aliases, names)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    missing, _ = network.load_state_dict(tensors, strict=False, assign=True)
    token = uuid.uuid4().hex[:12]
    tmp = fmt.temporary_path(dst, token)
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        if merge:
            if missing:  # state-dict names only: a non-persistent buffer is not missing
                raise PipelineCheckpointError(
                    f"Cannot merge {str(src)!r}: the checkpoint lacks {fmt.format_keys(missing)} of the recorded"
                    f" PEFT model (under {prefix!r}). Pass the attribute that holds it (`--attribute`)."
                )
            _tie(network)
            merged = network.merge_and_unload()
            merged.save_pretrained(tmp, max_shard_size=max_shard_size, safe_serialization=True)
            if generation is not None:
                generation.save_pretrained(tmp)
        else:
            network.save_pretrained(tmp, safe_serialization=True)
        replace_directory(tmp, dst, token)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


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
    from lightning_pipe.checkpoint.hf_export import meta_model  # hf_export imports this module

    peft = _peft()
    base = meta_model(hf_config, src)
    adapters = list(configs.items())
    with torch.device("meta"):
        network = peft.get_peft_model(base, peft.PeftConfig.from_peft_type(**adapters[0][1]), adapters[0][0])
        for adapter, values in adapters[1:]:
            network.add_adapter(adapter, peft.PeftConfig.from_peft_type(**values))
    return network


def _stored_keys(src: Path) -> set[str]:
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(src).read_metadata()
    return {k[len(fmt.MODEL_PREFIX) :] for k in metadata.state_dict_metadata if k.startswith(fmt.MODEL_PREFIX)}


def _read(
    src: Path,
    network: torch.nn.Module,
    prefix: str,
    stored: set[str],
    aliases: Mapping[str, str],
    names: list[str] | None,
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of ``names`` (every stored one of the PEFT model when ``None``), by the PEFT model's
    names; a tied parameter's other names are read from the one stored."""
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
                f"Cannot export the adapters of {str(src)!r}: it lacks {fmt.format_keys(lacking)} of the recorded"
                f" PEFT model (under {prefix!r}). Pass the attribute that holds it (`--attribute`)."
            )
    values: dict[str, torch.Tensor] = {}
    for chunk, _ in convert.read_entries(src, sorted({fmt.MODEL_PREFIX + k for k in keys.values()}), READ_BYTES):
        values.update(chunk)
    return {name: values[fmt.MODEL_PREFIX + key] for name, key in keys.items()}


def _tie(network: Any) -> None:
    """Tie the wrapped model's embeddings again: ``load_state_dict(assign=True)`` set each name's tensor apart."""
    model = network.get_base_model()
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()
