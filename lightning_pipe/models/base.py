"""The protocol a model kind implements: what the strategy needs to know about one kind of network.

A *model kind* (a plain ``nn.Module``, a transformers model, ...) answers, for one network:

- which units a stage may hold (:meth:`ModelKind.layout`), and in which order its forward runs them when values may
  cross stages (:meth:`ModelKind.dataflow_order`);
- what stands in for another stage's unit (:meth:`ModelKind.placeholder`) and how one stage runs one microbatch:
  where it enters the forward and where it leaves it (:attr:`ModelKind.stage_call`);
- its own tensor-parallel plan, if it has one (:meth:`ModelKind.tensor_parallel_plan`);
- the names its weights have on disk, relative to the network's own (:meth:`ModelKind.disk_names`), those a directory
  of another class of the family lacks or adds (:meth:`ModelKind.new_weights`), and what a
  checkpoint records to write it back in the family's format (:meth:`ModelKind.record`);
- the tensors its own initialisation leaves unset on the meta device and how to set them (:meth:`ModelKind.
  restore_buffers`);
- its files, as torchtitan's ``ModelSpec.state_dict_adapter`` (:meth:`ModelKind.state_dict_adapter`, a
  :class:`~lightning_pipe.models.files.StateDictAdapter`): its pretrained directories read per rank, its exports, its
  adapters in and out;
- how its ``generate`` decodes under a pipeline, if it has one (:meth:`ModelKind.decoding`, :class:`Decoding`).

The split, the checkpoint code and tensor parallelism ask :func:`lightning_pipe.models.kind_of` for the network's kind
and call these; they hold no family's knowledge themselves. A kind is added from outside with
:func:`lightning_pipe.models.register_kind`. Pure: no process group, no step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, Union

from torch import nn

from lightning_pipe.models.files import StateDictAdapter
from lightning_pipe.models.units import Layout

#: ``stage_call(body, args, kwargs, received, is_first, is_last) -> output``: runs a stage body on one microbatch.
#: ``args``/``kwargs`` are the microbatch's own network call (every rank captured it), ``received`` the activation
#: tensors the previous stage sent (``None`` on the first stage). A stage call may also tell the step layer that a
#: stage must run whole backward passes in the split-backward schedules (``full_backward(stage) -> bool``).
StageCall = Callable[[nn.Module, tuple, dict, Union[tuple, None], bool, bool], Any]


class WholeBackward:
    """A stage call whose stages run whole backward passes in the split-backward (zero-bubble) schedules.

    torch's split backward computes a stage's weight gradients group by group from the nodes where each weight's
    path meets the input's, freeing the graph as it goes; a weight used twice in a block, once upstream of the
    other (Gemma 3n's AltUp router, read by its predict and correct steps), needs a path another group has already
    freed. A whole backward computes the same gradients in one pass: the schedule keeps its order, and the stage's
    weight pass has nothing left to do.
    """

    def __init__(self, call: StageCall) -> None:
        self.call = call

    def __call__(self, body: nn.Module, args: tuple, kwargs: dict, received: tuple | None, *flags: bool) -> Any:
        return self.call(body, args, kwargs, received, *flags)

    def full_backward(self, stage: int) -> bool:
        return True


Placeholder = Callable[[str], "nn.Module | None"]
"""Given a unit's name, the module that stands in for it on stages that do not hold it; ``None``: remove it."""

#: ``(args, kwargs) -> (args, kwargs)``: a network call as the dataflow frontend runs it on every stage
PrepareCall = Callable[[nn.Module, tuple, dict], "tuple[tuple, dict]"]


class Decoding(Protocol):
    """How a kind's ``generate`` decodes under a pipeline (driven by :mod:`lightning_pipe.step.generation`): every
    rank runs the kind's own loop; each network call it makes is split into row chunks, each carrying the caches its
    stages keep between calls."""

    def check(self, network: nn.Module, args: tuple, kwargs: dict) -> None:
        """Refuse, naming the argument, a ``generate`` call whose decoding a pipeline cannot reproduce exactly."""
        ...

    def generate(self, network: nn.Module, args: tuple, kwargs: dict) -> Any:
        """The kind's own ``generate(*args, **kwargs)`` on this rank (its network calls go through the stages)."""
        ...

    def rows(self, kwargs: dict) -> int:
        """The number of sequences of a network call ``generate`` made."""
        ...

    def new_caches(self) -> Any:
        """The empty caches of one row chunk (each stage makes its own at its first call)."""
        ...

    def chunk(self, kwargs: dict, rows: int, start: int, stop: int, caches: Any) -> dict:
        """The network call ``kwargs`` (by name) for rows ``start:stop`` of ``rows``, carrying ``caches``."""
        ...

    def merge(self, outputs: list[Any]) -> Any:
        """The last stage's output of a call from its chunks' outputs, in row order, without stage caches."""
        ...

    def answer(self, output: Any, kwargs: dict) -> Any:
        """``output`` as ``generate`` expects it back from the network call ``kwargs``."""
        ...


class ModelKind(Protocol):
    """What the strategy knows about one kind of network (see the module docstring). Instances are made per network
    by :func:`lightning_pipe.models.kind_of`; every method takes the network (whole, or cut to a rank's stages)."""

    #: the kind's name, for messages and the split table ("plain module", "transformers LlamaForCausalLM", ...)
    name: str
    #: how one stage runs one microbatch under the default frontend
    stage_call: StageCall
    #: the network call as the dataflow frontend runs it (``None``: the call as made)
    prepare_dataflow_call: PrepareCall | None
    #: the network call as a stage of the default frontend makes it, for measuring units alone (``None``: as made)
    prepare_profile_call: PrepareCall | None

    def layout(self, network: nn.Module, blocks: str = "auto") -> Layout:
        """The network's units under the default frontend; ``blocks`` is the strategy's argument (``"auto"`` or the
        name of the block stack)."""
        ...

    def dataflow_order(self, network: nn.Module) -> list[str] | None:
        """The units and block stacks in the order the forward runs them, for ``frontend="dataflow"``; ``None``: found
        from the module tree."""
        ...

    def placeholder(self, network: nn.Module) -> Placeholder | None:
        """What stands in for another stage's unit under the default frontend (``None``: units are removed). Called on
        the whole network, before it is cut."""
        ...

    def tensor_parallel_plan(
        self, network: nn.Module, tensor_parallel: int, shared: Sequence[tuple[str, ...]] = ()
    ) -> dict[str, str] | None:
        """``{module name: style name}`` of the kind's own tensor-parallel plan for the modules ``network`` (cut to a
        rank's stages) holds, ``shared`` naming parameters tied before the cut; ``None``: the kind has no plan (the
        user applies one)."""
        ...

    def disk_names(self, network: nn.Module, name: str) -> Iterator[str]:
        """The names under which the tensor ``name`` (relative to ``network``) may be stored in the family's model
        directory, most likely first."""
        ...

    def ignored_on_load(self, network: nn.Module) -> tuple[list[str], list[str]]:
        """Regular expressions of the network's names a model directory may lack, and of the stored names the
        network may lack, without either being reported (the family's own loader ignores them)."""
        ...

    def new_weights(
        self, network: nn.Module, classes: Sequence[str], missing: Iterable[str], stored: Iterable[str]
    ) -> tuple[set[str], set[str]]:
        """For a directory of a model of the classes ``classes`` (its config's ``architectures``): which of the
        network's ``missing`` names (relative to it) are new to that class and keep the model's own initialisation
        (a classifier's head), and which ``stored`` names belong to that class only (a causal LM's head)."""
        ...

    def directory_type(self, network: nn.Module) -> str | None:
        """The model type a directory of this network's weights names in its config (``None``: not checked)."""
        ...

    def record(self, network: nn.Module, attribute: str) -> dict[str, Any] | None:
        """What a checkpoint records to export the network in its family's format (``None``: nothing to export)."""
        ...

    def restore_buffers(self, module: nn.Module) -> bool:
        """Set a submodule's tensors that its constructor computed and the meta device lost; ``True`` if it did."""
        ...

    def decoding(self) -> Decoding | None:
        """How the kind's ``generate`` decodes under a pipeline; ``None``: the kind cannot generate there."""
        ...

    def state_dict_adapter(self) -> StateDictAdapter | None:
        """The kind's files (its pretrained directories, exports, adapters); ``None``: the network's own names only
        (``init_weights`` takes lightning-pipe checkpoints and ``.ckpt`` files, ``export-hf`` refuses)."""
        ...
