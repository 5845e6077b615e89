"""What the strategy knows about model families, behind one protocol (:class:`~lightning_pipe.models.base.ModelKind`).

``kind_of(network)`` names the network's kind: the first claim that takes it, else a plain module. The claims are
tried most specific first: kinds added with :func:`register_kind` (the latest first), then the built-in ones of
:data:`KINDS` (PEFT before transformers, whose models it wraps). Each kind carries its own files
(:class:`~lightning_pipe.models.files.StateDictAdapter`), found by directory (:func:`files_reading`) or by the name a
checkpoint's record gives (:func:`files_named`); the split, checkpoints and tensor parallelism only call the protocol.

Adding a kind: a claim returning its :class:`ModelKind`, registered with :func:`register_kind` (a built-in one is a
module here and a line in :data:`KINDS`); nothing in ``split/`` or ``checkpoint/`` changes.

Layer: below ``split/`` and ``checkpoint/``, above ``compat/``; no process group, no step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from torch import nn

from lightning_pipe.models.base import ModelKind
from lightning_pipe.models.files import StateDictAdapter
from lightning_pipe.models.plain import PlainKind

#: ``claim(network) -> ModelKind | None``: a kind's :class:`ModelKind` for ``network``, or ``None`` when it is not one
Claim = Callable[[nn.Module], "ModelKind | None"]
#: ``restore(module) -> bool``: set a submodule's tensors that the meta device lost; ``True`` if it did
Restore = Callable[[nn.Module], bool]


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


def _rotary(module: nn.Module) -> bool:
    from lightning_pipe.models.huggingface.kind import HuggingFaceKind

    return HuggingFaceKind.restore_buffers(module)


def _rope_cache(module: nn.Module) -> bool:
    from lightning_pipe.models.litgpt import LitGPTKind

    return LitGPTKind.restore_buffers(module)


def _transformers_files() -> StateDictAdapter:
    from lightning_pipe.models.huggingface.files import HuggingFaceFiles

    return HuggingFaceFiles()


#: The built-in kinds' claims on a network, most specific first.
KINDS: tuple[Claim, ...] = (_peft, _huggingface, _litgpt)
#: The built-in kinds' submodule hooks: a transformers rotary embedding inside any network, litgpt's rope cache.
RESTORES: tuple[Restore, ...] = (_rotary, _rope_cache)
#: The built-in kinds' files, by a network-free lookup (PEFT adapters and exports go through the transformers files).
FILES: tuple[Callable[[], StateDictAdapter], ...] = (_transformers_files,)


@dataclass(frozen=True, eq=False)
class Registration:
    """A kind added by :func:`register_kind`; :meth:`remove` (or leaving its ``with`` block) takes it out again."""

    claim: Claim
    #: its submodule hook (:func:`restore_buffers`), if its modules compute tensors in their constructors
    restore: Restore | None = None
    #: its files, if it has a format of its own
    files: StateDictAdapter | None = None

    def remove(self) -> None:
        """Unregister the kind (again: nothing)."""
        if self in _registered:
            _registered.remove(self)

    def __enter__(self) -> Registration:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.remove()


#: kinds added from outside, the latest first
_registered: list[Registration] = []


def register_kind(
    claim: Claim, *, restore: Restore | None = None, files: StateDictAdapter | None = None
) -> Registration:
    """Add a model kind: ``claim`` is tried before every kind registered earlier and every built-in one (register
    the more general of two kinds first); ``restore`` is its hook on any submodule (:func:`restore_buffers`);
    ``files`` its :class:`~lightning_pipe.models.files.StateDictAdapter`, found without a network (a directory to
    start from, a checkpoint to export). Returns the registration: ``.remove()`` it, or use it as a context manager::

        with register_kind(claim, files=MyFiles()):
            trainer.fit(model)
    """
    registration = Registration(claim, restore, files)
    _registered.insert(0, registration)
    return registration


def kind_of(network: nn.Module) -> ModelKind:
    """The kind of ``network`` (whole or cut to a rank's stages)."""
    for claim in (*(r.claim for r in _registered), *KINDS):
        kind = claim(network)
        if kind is not None:
            return kind
    return PlainKind()


def _all_files() -> list[StateDictAdapter]:
    return [*(r.files for r in _registered if r.files is not None), *(make() for make in FILES)]


def files_reading(path: Path) -> StateDictAdapter | None:
    """The files of the kind whose directories ``path`` is one of (``None``: none); the checkpoint code asks only for
    a directory that is not a lightning-pipe checkpoint."""
    return next((files for files in _all_files() if files.reads(Path(path))), None)


def files_named(name: str) -> StateDictAdapter | None:
    """The files of the kind whose adapter is called ``name`` (a checkpoint's record names it); ``None``: none."""
    return next((files for files in _all_files() if files.name == name), None)


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
    """Set the tensors a submodule's constructor computed and the meta device lost, as the kind it belongs to does:
    each kind's submodule hook is asked, registered kinds first (a transformers rotary embedding inside any network,
    litgpt's rope cache); ``True`` if one did."""
    hooks = (*(r.restore for r in _registered if r.restore is not None), *RESTORES)
    return any(restore(module) for restore in hooks)
