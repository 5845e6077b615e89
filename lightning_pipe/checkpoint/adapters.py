"""A model's adapters from an adapter directory (``init_adapter=DIR``), each rank reading only its own stages' adapter
tensors: the network's kind plans them (``StateDictAdapter.plan_adapters``; a PEFT model's:
:mod:`lightning_pipe.models.peft_io`), this module agrees on the errors across ranks and copies.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from lightning_pipe.checkpoint.io import Topology, agree, local_step
from lightning_pipe.comm import collectives
from lightning_pipe.comm.dtensor import assign_whole_
from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.models import kind_of
from lightning_pipe.models.files import format_keys


def load_adapters(source: Path, topo: Topology, module: nn.Module, *, network_prefix: str) -> int:
    """Load this rank's adapter tensors of the network (``module``'s ``network_prefix`` attribute) from the adapter
    directory ``source``; returns the bytes this rank read. Every rank raises the same error: a network without
    adapters (not a PEFT model), a missing adapter or file, a config that differs, a tensor missing, left over or of
    another shape."""
    network = module.get_submodule(network_prefix[:-1]) if network_prefix else module
    files = kind_of(network).state_dict_adapter()
    problems: list[str] = []
    plans = local_step(problems, files.plan_adapters, Path(source), network) if files is not None else None
    if plans is None and not problems:  # the kind has no adapters: the same answer on every rank
        raise PipelineConfigError(
            f"`init_adapter={str(source)!r}` loads PEFT adapters, but the network ({type(network).__name__}) is not a"
            " PEFT model. Wrap it in `configure_model`: `self.model = peft.get_peft_model(model, LoraConfig(...))`,"
            " or leave out `init_adapter`."
        )
    agree(problems, f"Cannot load the adapter directory {str(source)!r}")
    # A stored tensor no rank's stages read: the adapter directory does not match the model.
    read = collectives.all_gather_object([sorted(p.targets) for p in plans], collectives.world_group())
    for i, plan in enumerate(plans):
        unread = plan.stored_names - {name for rank in read for name in rank[i]}
        if unread:
            problems.append(
                f"{plan.where} holds {format_keys(sorted(unread))}, which the model's adapter"
                " does not have. Build the PEFT model with the adapter directory's config"
                " (`peft.PeftConfig.from_pretrained(path)`)"
            )
    agree(problems, f"Cannot load the adapter directory {str(source)!r}")
    nbytes = [local_step(problems, files.copy_into, plan, assign_whole_) for plan in plans]
    agree(problems, f"Reading the adapter directory {str(source)!r} failed")
    return sum(nbytes)
