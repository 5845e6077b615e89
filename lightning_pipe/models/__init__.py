"""What the strategy knows about model families, behind one protocol (:class:`~lightning_pipe.models.base.ModelKind`).

``kind_of(network)`` names the network's kind: the first of :data:`KINDS` that claims it, else a plain module.
Adding a kind means a module here with its class and a line in :data:`KINDS`; the split, checkpoints and tensor
parallelism only call the protocol.

Layer: below ``split/`` and ``checkpoint/``, above ``compat/``; no process group, no step.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from lightning_pipe.models.base import ModelKind
from lightning_pipe.models.plain import PlainKind


def _huggingface(network: nn.Module) -> ModelKind | None:
    from lightning_pipe.models.huggingface.plan import is_hf_model

    if not is_hf_model(network):
        return None
    from lightning_pipe.models.huggingface.kind import HuggingFaceKind

    return HuggingFaceKind(network)


def _peft(network: nn.Module) -> ModelKind | None:
    from lightning_pipe.models.peft import PeftKind, is_peft_model

    return PeftKind(network) if is_peft_model(network) else None


def _litgpt(network: nn.Module) -> ModelKind | None:
    from lightning_pipe.models.litgpt import LitGPTKind, is_litgpt_gpt

    return LitGPTKind() if is_litgpt_gpt(network) else None


#: Each kind's claim on a network, most specific first: its :class:`ModelKind`, or ``None`` when it is not one.
KINDS: tuple[Callable[[nn.Module], ModelKind | None], ...] = (_peft, _huggingface, _litgpt)


def kind_of(network: nn.Module) -> ModelKind:
    """The kind of ``network`` (whole or cut to a rank's stages)."""
    for claim in KINDS:
        kind = claim(network)
        if kind is not None:
            return kind
    return PlainKind()


def use_plan(network: nn.Module, plan: dict[str, tuple[list[str], list[str]]]) -> None:
    """Give ``network`` the user's pipeline plan (the strategy's ``model_plan``): a transformers model (or the one a
    PEFT model wraps) whose family has none; names are relative to that transformers model. Raises
    ``PipelineConfigError`` for any other network, a model with a plan of its own, or a name the model lacks."""
    from lightning_pipe.errors import PipelineConfigError
    from lightning_pipe.models.huggingface.plan import install_plan, is_hf_model
    from lightning_pipe.models.peft import inner_model, is_peft_model

    model = inner_model(network) if is_peft_model(network) else network
    if not is_hf_model(model):
        raise PipelineConfigError(
            f"`model_plan` describes a transformers model, but the network is a {kind_of(network).name}"
            f" ({type(network).__name__}). Drop `model_plan`, and name its blocks with `blocks=` (or cut it with"
            " `split_points=`)."
        )
    install_plan(model, plan)


def restore_buffers(module: nn.Module) -> bool:
    """Set the tensors a submodule's constructor computed and the meta device lost, as the kind it belongs to does
    (a transformers rotary embedding inside any network, litgpt's rope cache); ``True`` if one did."""
    from lightning_pipe.models.huggingface.plan import restore_rotary_buffers
    from lightning_pipe.models.litgpt import restore_rope_cache

    return restore_rotary_buffers(module) or restore_rope_cache(module)
