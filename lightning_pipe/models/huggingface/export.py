"""A lightning-pipe checkpoint of a transformers network as ``save_pretrained`` writes it, for ``from_pretrained``:
what ``python -m lightning_pipe.checkpoint export-hf CKPT_DIR OUT_DIR`` writes (the transformers kind's
:meth:`~lightning_pipe.models.huggingface.files.HuggingFaceFiles.export`).

The output is what ``save_pretrained`` writes: ``config.json`` (and ``generation_config.json`` for a model that
generates), the weights in safetensors shards of at most ``max_shard_size`` with ``model.safetensors.index.json``
(one ``model.safetensors`` when they fit in one), under the network's own names, each tied parameter once under the
name transformers keeps (the input embedding's, not ``lm_head.weight``).

The config comes from the checkpoint (recorded by ``PipelineParallelStrategy`` when it saved a transformers network:
the kind's ``record``, the manifest's ``"huggingface"`` entry) or from ``config``, a Hugging Face directory such as
the one the run started from. The names and ties to write are those of the transformers model built from that
config on the meta device, so a checkpoint of another model is refused with the names that differ.

Memory: tensors are read from the checkpoint in order, a few MiB at a time (:data:`READ_BYTES`; a larger tensor
alone), and streamed into the shard files through a safetensors header written first (``safetensors.torch.save_file``
would hold a whole shard, and a copy of it). ``torch.distributed.checkpoint`` reads a stored tensor into a temporary
before copying it into place, so the peak is about twice the largest tensor, plus :data:`READ_BYTES`, plus the
runtime. The checkpoint code writes into a temporary directory and renames it: the export appears complete or not at
all (:func:`lightning_pipe.checkpoint.export.export`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.errors import PipelineCheckpointError
from lightning_pipe.models.files import CheckpointEntries, ExportOptions, format_keys
from lightning_pipe.models.huggingface.directory import CONFIG, GENERATION_CONFIG, SAFETENSORS, SAFETENSORS_INDEX

#: bytes read from the checkpoint at once (a larger tensor is read alone)
READ_BYTES = 16 * 2**20
INDEX = SAFETENSORS_INDEX
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}


def parse_size(size: int | str) -> int:
    """Bytes of a shard size written as transformers takes it: an int, or ``"5GB"``, ``"500MB"``, ``"2GiB"``..."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    text = str(size).strip().upper()
    for unit, scale in _UNITS.items():
        number = text[: -len(unit)].strip()
        if text.endswith(unit) and number.replace(".", "", 1).isdigit() and float(number) > 0:
            return int(float(number) * scale)
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise PipelineCheckpointError(
        f"`max_shard_size={size!r}` is not a size: give a positive number of bytes, or a string such as '5GB',"
        " '500MB' or '2GiB'."
    )


@dataclass(frozen=True)
class Entry:
    """One tensor of the export: its Hugging Face name, its checkpoint key, and the shape and dtype written."""

    name: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()


# ---------------------------------------------------------------------------------------------------- planning
def plan_entries(
    stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    expected: Mapping[str, tuple[int, ...]],
    ties: Iterable[Sequence[str]],
    prefix: str,
    aliases: Mapping[str, str],
    dtype: torch.dtype | None = None,
) -> list[Entry]:
    """The tensors to write, in ``expected``'s order, each tie group once under its first name (pure).

    ``stored``: the checkpoint's model entries (LightningModule names, without ``state_dict.``) with shape and dtype;
    ``expected``: the transformers model's state-dict names (without ``prefix``, the LightningModule's attribute)
    and shapes; ``ties``: its groups of names of one parameter; ``aliases``: the checkpoint's ``{name: first name}``
    of parameters stored once. ``dtype``: write floating-point tensors in it (``None``: as stored). Raises
    :class:`PipelineCheckpointError` naming the entries that are missing, unexpected or of another shape.
    """
    dropped = {name for group in ties for name in group[1:]}
    entries: list[Entry] = []
    missing: list[str] = []
    wrong: list[str] = []
    for name, shape in expected.items():
        if name in dropped:
            continue
        key = prefix + name
        key = key if key in stored else aliases.get(key, key)
        if key not in stored:
            missing.append(name)
        elif tuple(stored[key][0]) != tuple(shape):
            wrong.append(f"{name!r} is {list(stored[key][0])} in the checkpoint but {list(shape)} in the config")
        else:
            written = dtype if dtype is not None and stored[key][1].is_floating_point else stored[key][1]
            entries.append(Entry(name, key, tuple(shape), written))
    known = {prefix + name for name in expected}
    unexpected = sorted(k[len(prefix) :] for k in stored if k.startswith(prefix) and k not in known)
    problems = []
    if missing:
        problems.append(f"the config's model has {format_keys(missing)}, which the checkpoint lacks")
    if unexpected:
        problems.append(f"the checkpoint holds {format_keys(unexpected)}, which the config's model lacks")
    if wrong:
        more = f"; and {len(wrong) - 4} more" if len(wrong) > 4 else ""
        problems.append("shape mismatch: " + "; ".join(wrong[:4]) + more)
    if problems:
        raise PipelineCheckpointError("; ".join(problems))
    return entries


def plan_shards(entries: Sequence[Entry], max_bytes: int) -> list[list[Entry]]:
    """``entries`` in order, cut into shards of at most ``max_bytes`` (a larger tensor gets a shard of its own)."""
    shards: list[list[Entry]] = []
    size = 0
    for entry in entries:
        if not shards or size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return [shard for shard in shards if shard]


def shard_files(count: int) -> list[str]:
    """The file names ``save_pretrained`` gives ``count`` shards."""
    if count == 1:
        return [SAFETENSORS]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def safetensors_header(entries: Sequence[Entry]) -> bytes:
    """The start of a safetensors file holding ``entries`` in order, back to back: the header's length (8 bytes,
    little-endian), then the JSON header padded with spaces to a multiple of 8 bytes (so tensors stay aligned)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # from_pretrained refuses files without it
    offset = 0
    for e in entries:
        if e.dtype not in _SAFETENSORS_DTYPES:
            raise PipelineCheckpointError(f"{e.name!r} has dtype {e.dtype}, which safetensors cannot store.")
        header[e.name] = {
            "dtype": _SAFETENSORS_DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_tensor(f: Any, tensor: torch.Tensor) -> None:
    """Append ``tensor``'s bytes (C order, the machine's little-endian layout) to the binary file ``f``."""
    flat = tensor.detach().contiguous().reshape(-1)
    f.write(memoryview(flat.view(torch.uint8).numpy()))


# ---------------------------------------------------------------------------------------------------- export
def export(
    entries: CheckpointEntries, out: Path, options: ExportOptions, hf_config: Any, generation: Any, recorded: str | None
) -> None:
    """Write the checkpoint ``entries`` into the empty directory ``out`` as a Hugging Face model directory (see the
    module docstring): ``hf_config``/``generation``/``recorded`` from :func:`configs`; ``options.attribute``: the
    LightningModule's attribute holding the network (``None``: ``recorded``, or found from the names)."""
    src = entries.path
    max_bytes = parse_size(options.max_shard_size)
    model = meta_model(hf_config, src)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    stored = entries.stored
    prefix = _prefix(options.attribute if options.attribute is not None else recorded, stored, expected, src)
    try:
        planned = plan_entries(stored, expected, _ties(model), prefix, entries.aliases, options.dtype)
    except PipelineCheckpointError as err:
        raise PipelineCheckpointError(
            f"Cannot export {str(src)!r} as a {type(model).__name__}: {err}. Give the config the run trained"
            " (`--config` the directory it started from) and the attribute holding the network (`--attribute`)."
        ) from None
    skipped = sorted(k for k in stored if not k.startswith(prefix))
    if skipped:  # the LightningModule's own parameters beside the network (a value head, ...)
        print(f"export-hf: left out the entries outside {prefix!r}: {format_keys(skipped)}", file=sys.stderr)
    _set_dtype(hf_config, planned)
    hf_config.save_pretrained(out)
    if generation is not None:
        generation.save_pretrained(out)
    _write_shards(entries, out, plan_shards(planned, max_bytes), options.progress)


def configs(entries: CheckpointEntries, config: Path | None) -> tuple[Any, Any, str | None]:
    """The transformers config, generation config (or ``None``) and recorded attribute to export with."""
    transformers = _transformers()
    record = entries.record
    if config is not None:
        config = Path(config)
        if not (config / CONFIG).is_file():
            raise PipelineCheckpointError(
                f"`--config {str(config)!r}` has no {CONFIG}: give the Hugging Face model directory the run started"
                " from."
            )
        generation = None
        if (config / GENERATION_CONFIG).is_file():
            generation = transformers.GenerationConfig.from_pretrained(config)
        attribute = record.get("attribute") if record else None
        return transformers.AutoConfig.from_pretrained(config), generation, attribute
    if record is None:
        raise PipelineCheckpointError(
            f"{str(entries.path)!r} records no Hugging Face config ({entries.description}): it was saved by an earlier"
            " lightning-pipe, or its network is not a transformers model. Pass `--config` the Hugging Face model"
            " directory the run started from (its config.json is used)."
        )
    hf_config = transformers.AutoConfig.for_model(**record["config"])
    generation = record.get("generation_config")
    generation = transformers.GenerationConfig.from_dict(generation) if generation is not None else None
    return hf_config, generation, record.get("attribute")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise PipelineCheckpointError(
            "Exporting for `from_pretrained` needs transformers: `pip install 'lightning-pipe[hf]'`."
        ) from err
    return transformers


def meta_model(config: Any, src: Path) -> torch.nn.Module:
    """The config's model on the meta device: its state-dict names, shapes and ties, without memory."""
    transformers = _transformers()
    name = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        raise PipelineCheckpointError(
            f"The config of {str(src)!r} names the architecture {name!r}, which this transformers"
            f" ({transformers.__version__}) does not have. Export with the transformers version that trained it, or"
            " pass `--config` a directory whose config.json names the model class in 'architectures'."
        )
    with torch.device("meta"):
        return cls(config)


def _ties(model: torch.nn.Module) -> list[list[str]]:
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _prefix(attribute: str | None, stored: Mapping[str, Any], expected: Mapping[str, Any], src: Path) -> str:
    """The LightningModule's attribute as a name prefix: given, or the one under which the model's names are stored."""
    if attribute is not None:
        return f"{attribute}." if attribute else ""
    found = {key[: -len(name)] for name in expected for key in stored if key.endswith(name)}
    found = {p for p in found if p == "" or p.endswith(".")}
    best = max(sorted(found), key=lambda p: sum(p + n in stored for n in expected), default=None)
    if best is None:
        raise PipelineCheckpointError(
            f"No entry of {str(src)!r} has a name of the config's model; pass the attribute that holds the network"
            " (`--attribute model`)."
        )
    return best


def _set_dtype(config: Any, entries: Sequence[Entry]) -> None:
    """Record the weights' dtype in the config, as ``save_pretrained`` does (``dtype``; ``torch_dtype`` before 4.56)."""
    floating = [e.dtype for e in entries if e.dtype.is_floating_point]
    if floating:
        name = str(floating[0]).removeprefix("torch.")
        keys = config.to_dict()
        setattr(config, "torch_dtype" if "torch_dtype" in keys and "dtype" not in keys else "dtype", name)


def _write_shards(source: CheckpointEntries, out: Path, shards: Sequence[Sequence[Entry]], progress: bool) -> None:
    from tqdm import tqdm

    files = shard_files(len(shards))
    total = sum(e.nbytes for shard in shards for e in shard)
    tensors = _read_in_order(source, [e for shard in shards for e in shard])
    with tqdm(total=total, unit="B", unit_scale=True, desc="export-hf", disable=not progress, file=sys.stderr) as bar:
        for file, shard in zip(files, shards):
            with open(out / file, "wb") as f:
                f.write(safetensors_header(shard))
                for entry in shard:
                    write_tensor(f, next(tensors).to(entry.dtype))
                    bar.update(entry.nbytes)
                f.flush()
                os.fsync(f.fileno())
    if len(shards) > 1:
        weight_map = {e.name: file for file, shard in zip(files, shards) for e in shard}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _read_in_order(source: CheckpointEntries, entries: Sequence[Entry]) -> Iterator[torch.Tensor]:
    """Each entry's stored tensor, in order, read :data:`READ_BYTES` at a time and dropped once written."""
    for chunk in source.read([e.key for e in entries], READ_BYTES):
        for key in list(chunk):
            yield chunk.pop(key)
