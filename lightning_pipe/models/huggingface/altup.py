"""AltUp (Gemma 3n's text model): between its blocks the hidden states are a stack of ``altup_num_inputs`` streams.

transformers' Gemma 3n builds the stack before the blocks, from the token embeddings and one projection per extra
stream (``altup_projections``), shape ``(altup_num_inputs, batch, tokens, hidden)``; every block takes and returns
that stack; after the blocks one projection per extra stream (``altup_unembed_projections``) and a mean merge it
back into one ``(batch, tokens, hidden)`` tensor for the final norm. Under the pipeline:

- each projection is a unit of the plan (:func:`plan_entries`): the ones that build the stack before the blocks,
  held by the first stage with the token embedding; the ones that merge it after the blocks, held by the last stage
  with the final norm and the head;
- the stage boundary sits between blocks, so what crosses it is the whole stack, as the next block takes it on one
  device: a 4-D tensor whose batch is its second dimension (the microbatches are cut from the inputs, never from
  what crosses);
- on a later stage the embedding's stand-in returns zeros shaped like one stream (:func:`embedding_like`), so the
  forward builds its masks and positions from ``(batch, tokens, hidden)`` as on the first stage.
"""

from __future__ import annotations

from torch import Tensor, nn

BEFORE = "altup_projections"
"""The base model's projections that build the extra streams before the blocks."""
AFTER = "altup_unembed_projections"
"""The base model's projections that merge the extra streams back after the blocks."""


def streams(base: nn.Module | None) -> int:
    """How many hidden-state streams the blocks of ``base`` take (``altup_num_inputs``): 1 without AltUp."""
    config = getattr(base, "config", None)
    count = getattr(config, "altup_num_inputs", 1) or 1
    lists = [getattr(base, name, None) for name in (BEFORE, AFTER)]
    return int(count) if count > 1 and all(isinstance(projections, nn.ModuleList) for projections in lists) else 1


def needs_whole_backward(model: nn.Module) -> bool:
    """Whether the stages of the transformers ``model`` (or of the one a PEFT model wraps) run whole backward passes
    (:class:`lightning_pipe.models.base.WholeBackward`): AltUp's blocks (Gemma 3n) do, since each reads its router's
    weights twice, once upstream of the other."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    return streams(model) > 1 or (isinstance(base, nn.Module) and streams(base) > 1)


def plan_entries(base: nn.Module) -> tuple[list[str], list[str]]:
    """The AltUp projections of ``base`` (names relative to it), one unit each: those to put into its pipeline plan
    before the blocks, and those after them (before the final norm)."""
    if streams(base) == 1:
        return [], []
    return [f"{BEFORE}.{key}" for key, _ in getattr(base, BEFORE).named_children()], [
        f"{AFTER}.{key}" for key, _ in getattr(base, AFTER).named_children()
    ]


def embedding_like(base: nn.Module | None, hidden: Tensor) -> Tensor:
    """What the token embedding returns, in shape, on a stage that receives ``hidden``: one stream of the AltUp
    stack, or ``hidden`` itself for a model without AltUp."""
    if streams(base) > 1 and hidden.dim() == 4 and hidden.shape[0] == streams(base):
        return hidden[0]
    return hidden
