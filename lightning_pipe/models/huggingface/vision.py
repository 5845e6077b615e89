"""transformers vision-language models (Llava, Qwen2-VL, Gemma3, ...): a vision tower and a projector in front of a
decoder, cut where the decoder's own pipeline plan says.

Their configs are composite and carry no ``base_model_pp_plan``; their ``text_config`` does, and the decoder is a
sub-model built from it (``model.language_model``). The plan (:func:`vision_plan`) is the decoder's, with the
vision modules (the decoder's siblings: ``model.vision_tower``, ``model.multi_modal_projector``) after its embedding
on the first stage, as torchtitan places them, and the task model's head (``lm_head``) on the last.

The forward embeds the tokens, runs the vision tower on ``pixel_values`` and writes the image features into the
embeddings at the image tokens. On a later stage the embeddings are stand-in zeros that the stage's first block
never reads, so the stage's call leaves the pixels out (:func:`later_stage_call`) and the vision stand-ins are not
run; what the decoder derives from the inputs (masks, Qwen2-VL's 3-D rope positions from ``input_ids`` and
``image_grid_thw``, Gemma3's bidirectional image-token mask from ``token_type_ids``) is computed on every stage.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

#: The call's arguments that only the vision tower reads: left out on stages after the first.
VISION_INPUTS = ("pixel_values", "pixel_values_videos")

_Plan = dict[str, tuple[list[str], list[str]]]


def _is_pretrained(module: nn.Module) -> bool:
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(module, modeling.PreTrainedModel)


def language_model(network: nn.Module) -> str | None:
    """Where a composite model without a pipeline plan of its own keeps the decoder its ``text_config`` plans
    (``"model.language_model"``); ``None`` for a model with its own plan or without such a decoder."""
    config = getattr(network, "config", None)
    if getattr(config, "base_model_pp_plan", None) or getattr(config, "text_config", None) is None:
        return None
    for name, sub in network.named_modules():
        plan = getattr(getattr(sub, "config", None), "base_model_pp_plan", None)
        if name and plan and _is_pretrained(sub) and all(entry in dict(sub.named_children()) for entry in plan):
            return name
    return None


def vision_plan(network: nn.Module) -> _Plan | None:
    """The pipeline plan of a composite vision-language model, relative to ``network``: the decoder's embedding, the
    vision modules, the decoder's blocks and norm, the task model's head; ``None`` if it is not one."""
    decoder = language_model(network)
    if decoder is None:
        return None
    text_plan = dict(network.get_submodule(decoder).config.base_model_pp_plan)
    parent, _, leaf = decoder.rpartition(".")
    owner = network.get_submodule(parent) if parent else network
    dotted = f"{parent}." if parent else ""
    entries = [(f"{decoder}.{name}", (list(spec[0]), list(spec[1]))) for name, spec in text_plan.items()]
    stack = next(i for i, (name, _) in enumerate(entries) if _is_stack(network.get_submodule(name)))
    vision = [(f"{dotted}{name}", (["pixel_values"], ["image_features"])) for name, _ in owner.named_children()]
    vision = [entry for entry in vision if entry[0] != decoder]
    top = decoder.split(".", 1)[0]
    heads = [(name, (["hidden_states"], ["logits"])) for name, _ in network.named_children() if name != top]
    return dict(entries[:stack] + vision + entries[stack:] + heads)


def _is_stack(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict))


def later_stage_call(call: dict[str, Any]) -> dict[str, Any]:
    """The call of a stage after the first: without the pixels, whose features only reach the embeddings that the
    stage replaces by the hidden states it receives (checked once per stage, :mod:`.stage`)."""
    return {name: None if name in VISION_INPUTS else value for name, value in call.items()}


#: Where a vision-language model's directory may store its weights (``{stored prefix: network prefix}``) besides the
#: network's own names: what ``save_pretrained`` writes for Llava and Gemma3 in transformers 4.54-5.24 (4.x's
#: ``_checkpoint_conversion_mapping``; 5.x writes the same names and reads them through its ``conversion_mapping``).
OLDER_NAMES: dict[str, dict[str, str]] = {
    cls: {
        "language_model.model": "model.language_model",
        "language_model.lm_head": "lm_head",
        "vision_tower": "model.vision_tower",
        "multi_modal_projector": "model.multi_modal_projector",
    }
    for cls in ("LlavaForConditionalGeneration", "Gemma3ForConditionalGeneration")
}
#: the submodule of a vision tower (``CLIPVisionModel``, ``SiglipVisionModel``) that transformers 4.x builds and 5.x
#: leaves out (5.x builds the vision transformer itself): ``vision_tower.vision_model.*`` in 4.x, ``vision_tower.*``
#: in 5.x; each reads the other's directory
TOWER_WRAPPER = "vision_model"


def tower_names(network: nn.Module, name: str) -> list[str]:
    """``name``, and, for a weight of the vision tower, its name with the vision tower's wrapper (:data:`TOWER_WRAPPER`)
    removed or added: the name a directory written by the other transformers major version stores it under."""
    tower = next((p for p in OLDER_NAMES.get(type(network).__name__, {}).values() if p.endswith(".vision_tower")), None)
    if tower is None or not name.startswith(tower + "."):
        return [name]
    rest = name[len(tower) + 1 :]
    if rest.startswith(TOWER_WRAPPER + "."):
        return [name, f"{tower}.{rest[len(TOWER_WRAPPER) + 1 :]}"]
    return [name, f"{tower}.{TOWER_WRAPPER}.{rest}"]
