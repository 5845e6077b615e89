"""transformers task heads that the family's pipeline plan does not name: sequence classification (reward models,
classifiers), token classification and extractive question answering.

Their forward is the base model, then the head on its last hidden states (``score``, ``classifier``, ``qa_outputs``);
the sequence classifier pools each sample's last non-pad token, found from ``input_ids``, which every stage's call
holds (each stage runs the whole model's forward with the microbatch's own call). So the head is one more unit after
the final norm, on the last stage.

A directory of another class of the same family (a causal LM's, a base model's) starts such a model as
``from_pretrained`` does: the head it lacks keeps the model's own initialisation, and its own head is not read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

TASK_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
"""The task models (class name suffixes) whose heads are added to transformers' plan, which has none."""

#: the plan entry of a task head: it reads the last hidden states
HEAD_SPEC = (["hidden_states"], ["logits"])


def task_heads(network: nn.Module, prefix: str) -> list[str]:
    """The heads of a sequence-, token-classification or question-answering model: its children with parameters
    besides the base model (``prefix``), in definition order."""
    if not type(network).__name__.endswith(TASK_HEADS) or not prefix:
        return []
    return [
        name for name, child in network.named_children() if name != prefix and any(True for _ in child.parameters())
    ]


def new_weights(
    network: nn.Module, prefix: str, classes: Sequence[str], missing: Iterable[str], stored: Iterable[str]
) -> tuple[set[str], set[str]]:
    """For a directory holding a model of the classes ``classes`` (its config's ``architectures``), other than the
    network's: which of the network's ``missing`` names are a task head new to it, and which ``stored`` names are
    the directory's own head (neither reported, as ``from_pretrained`` does). A causal LM's directory loaded into a
    sequence classifier: ``({"score.weight"}, {"lm_head.weight"})``."""
    if not prefix or not classes or type(network).__name__ in classes:
        return set(), set()
    heads = tuple(head + "." for head in task_heads(network, prefix))
    ours = {name for name in missing if heads and name.startswith(heads)}
    # a base model's own directory stores the base model's children without the prefix
    base = {name for name, _ in network.get_submodule(prefix).named_children()}
    theirs = {name for name in stored if not name.startswith(prefix + ".") and name.split(".", 1)[0] not in base}
    return ours, theirs
