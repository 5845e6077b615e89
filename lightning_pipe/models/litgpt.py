"""litgpt's ``GPT`` (the ``litgpt`` package, its LoRA ``GPT`` too): an ordinary module whose forward does not skip
absent units, so it runs whole on every stage (``frontend="dataflow"``, values routed to the stages that read them).

- **Order.** ``lm_head`` is defined before ``transformer`` but runs last: the dataflow order is the forward's
  (``transformer.wte``, ``transformer.h``, ``transformer.ln_f``, ``lm_head``), not the module tree's.
- **Rope cache.** ``cos``/``sin`` are non-persistent buffers computed in ``__init__`` (``max_seq_length``); built on
  the meta device they have no values and are recomputed from the config (``GPT.rope_cache``).
- **Default frontend.** ``frontend="modules"`` would give a later stage the activation in place of ``idx``, which
  litgpt's forward embeds again: refused by name, before the cut.
- ``lm_head_chunk_size`` (the forward returns a list of logit chunks) needs nothing: the last stage's output reaches
  the step function as the forward returned it.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.models.base import Placeholder
from lightning_pipe.models.plain import PlainKind

#: litgpt's forward order of units and block stacks
ORDER = ["transformer.wte", "transformer.h", "transformer.ln_f", "lm_head"]


def is_litgpt_gpt(module: nn.Module) -> bool:
    """Whether ``module`` is litgpt's ``GPT`` (or a subclass: ``litgpt.lora.GPT``); litgpt is not imported here."""
    model = sys.modules.get("litgpt.model")
    return model is not None and isinstance(module, model.GPT)


class LitGPTKind(PlainKind):
    """litgpt's ``GPT`` (:class:`~lightning_pipe.models.base.ModelKind`; see the module docstring)."""

    name = "litgpt GPT"

    def dataflow_order(self, network: nn.Module) -> list[str] | None:
        return list(ORDER)

    def placeholder(self, network: nn.Module) -> Placeholder | None:
        raise PipelineConfigError(
            f"litgpt's {type(network).__name__} runs its forward whole on every stage (it does not skip the units"
            " other stages hold): pass `frontend='dataflow'` to the pipeline strategy. The dataflow frontend does not"
            " take `tensor_parallel > 1`, so a litgpt GPT is pipelined without tensor parallelism (data parallelism"
            " instead)."
        )

    @staticmethod
    def restore_buffers(module: nn.Module) -> bool:
        """litgpt's rope cache (also the submodule hook of :func:`lightning_pipe.models.restore_buffers`)."""
        return restore_rope_cache(module)


def restore_rope_cache(module: nn.Module) -> bool:
    """Recompute litgpt's ``cos``/``sin`` rope cache (lost on the meta device); ``True`` if ``module`` is a GPT."""
    if not is_litgpt_gpt(module) or not isinstance(getattr(module, "cos", None), torch.Tensor):
        return False
    cos, sin = module.rope_cache(device=module.cos.device)
    with torch.no_grad():
        module.cos.copy_(cos.to(module.cos.dtype))
        module.sin.copy_(sin.to(module.sin.dtype))
    return True
