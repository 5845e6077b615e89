"""The transformers and peft kinds' files (:class:`~lightning_pipe.models.files.StateDictAdapter`): a
``save_pretrained`` directory read per rank (:mod:`.directory`), a checkpoint exported for ``from_pretrained``
(:mod:`.export`), and a PEFT model's adapter directories in and out (:mod:`lightning_pipe.models.peft_io`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import nn

from lightning_pipe.errors import PipelineCheckpointError
from lightning_pipe.models import peft_io
from lightning_pipe.models.files import Assign, CheckpointEntries, ExportOptions, LoadPlan, LoadTarget, copy_whole
from lightning_pipe.models.huggingface import directory, export


class HuggingFaceFiles:
    """A transformers model's files: ``save_pretrained`` directories, and exports of its checkpoints (with
    ``adapter``/``merge``, a PEFT model's)."""

    name = "transformers"
    title = "Hugging Face model directory"

    def reads(self, path: Path) -> bool:
        return directory.is_hf_directory(path)

    def plan_load(self, path: Path, target: LoadTarget) -> LoadPlan:
        return directory.plan_load(
            path, target.state, target.network, target.kind, target.network_prefix, target.groups
        )

    def copy_into(self, plan: LoadPlan, assign: Assign = copy_whole) -> int:
        return directory.copy_into(plan, assign)

    def plan_adapters(self, path: Path, network: nn.Module) -> list[LoadPlan] | None:
        return None  # a transformers model without peft has no adapters

    def mismatch_message(self, path: Path, missing: Sequence[str], unexpected: Sequence[str], strict: bool) -> str:
        return directory.mismatch_message(path, missing, unexpected, strict)

    def new_head_message(self, path: Path, network: nn.Module, plan: LoadPlan, keys: Sequence[str]) -> str:
        return directory.new_head_message(path, network, plan.directory, keys)

    def export(self, entries: CheckpointEntries, out: Path, options: ExportOptions) -> None:
        """A transformers model as ``save_pretrained`` writes it (:func:`.export.export`); a PEFT model's adapters
        (``options.adapter``) or the model with them merged in (``options.merge``): :func:`.peft_io.export`."""
        hf_config, generation, recorded = export.configs(entries, options.config)
        peft_record = (entries.record or {}).get(peft_io.PEFT)
        adapter, merge = options.adapter, options.merge
        if adapter and merge:
            raise PipelineCheckpointError("`--adapter` and `--merge` exclude each other: pass one of them.")
        if peft_record is None and not (adapter or merge):
            export.export(entries, out, options, hf_config, generation, recorded)
            return
        if peft_record is None:
            raise peft_io.refuse_not_peft(entries.path, "--adapter" if adapter else "--merge")
        if not (adapter or merge):
            raise peft_io.refuse_plain_export(entries.path)
        attribute = options.attribute if options.attribute is not None else recorded
        prefix = f"{attribute}." if attribute else ""
        peft_io.export(
            entries,
            out,
            hf_config,
            generation,
            prefix,
            merge=merge,
            max_shard_size=options.max_shard_size,
            dtype=options.dtype,
        )


class PeftFiles(HuggingFaceFiles):
    """A PEFT model's files: its base model's, and its adapters from an adapter directory (``init_adapter``)."""

    def plan_adapters(self, path: Path, network: nn.Module) -> list[LoadPlan] | None:
        return peft_io.plan_adapters(Path(path), network)
