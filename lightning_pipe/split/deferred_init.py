"""Initialisation written any way, kept through the meta device: recorded in ``configure_model``, replayed per rank.

On the meta device an in-place initialisation does nothing: ``self.net.apply(gpt2_init)``, a loop of
``nn.init.normal_`` over ``named_parameters()``, ``p.data.normal_()`` or a ``fill_`` under ``torch.no_grad()``
leave no values behind. While ``configure_model`` runs, :func:`record_init` records every operator that touches a
meta tensor (the deferred-init idea of torchdistx); after the split, :meth:`InitRecording.replay` re-runs, on each
rank's own allocated parameters and buffers, the recorded operators that set them (and the temporaries they read, as
``nn.init.orthogonal_``'s QR factors), in their recorded order.

Two orders (the strategy's ``init_values``). ``"one_device"`` (:meth:`InitRecording.replay_in_order`): every
recorded operator in recorded order, from the global random streams as they were when ``configure_model`` began; the
operators that set this rank's tensors run on them, the random ones that set other ranks' tensors draw into a
scratch tensor and are discarded, so the values are one device's and the streams end where one device's end.
``"per_unit"`` (:meth:`InitRecording.replay`): each parameter's operators under their own seed, ``seed + crc32(name)``
with the parameter's first name in the full model (:func:`lightning_pipe.split.seeding.unit_seed`), so its values
do not depend on the layout or on which rank holds it, and no rank draws for another; a recorded random operator with
its own ``generator=`` draws from that seed too. What follows is about ``"per_unit"``.

A parameter that is a plain copy of another one drawn at random (``b = a.clone()``, ``copy.deepcopy(module)``, as
PEFT's ``modules_to_save`` copies the head it trains) is not replayed under its own seed: once the rank's tensors are
initialised (replay, then the model's init hook), it takes the other's value (:meth:`InitRecording.copy_deferred`),
as it did on one device. Other values that cannot be rebuilt from the parameter's own operators are refused, naming
the parameter and the call (:class:`~lightning_pipe.errors.PipelineModelError`): one computed from another parameter
or buffer drawn at random (``b.copy_(a * 2)``, a copy of ``a`` that ``a`` later changes, or a copy whose original
lies on another rank), or a parameter that is a view into a larger tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from lightning_pipe.compat import torch as torch_compat
from lightning_pipe.errors import PipelineModelError
from lightning_pipe.split.seeding import StreamCall, Streams, seeded, stream_calls


def _key(t: Tensor) -> int:
    """A tensor's storage: views and ``.data`` aliases of a parameter share it."""
    return StorageWeakRef(t.untyped_storage()).cdata


@dataclass
class _Op:
    """One recorded operator call: ``func(*args, **kwargs)``, the storages it writes in place, creates and reads."""

    func: Any
    args: tuple
    kwargs: dict
    writes: frozenset[int]
    creates: frozenset[int]
    reads: frozenset[int]
    outputs: list[Tensor]
    site: str
    #: run by a ``torch.nn`` module's ``reset_parameters()`` (PyTorch's defaults), which a model's own init overrides
    default: bool = False

    def describe(self) -> str:
        name = getattr(self.func, "__name__", str(self.func))
        return f"`{name}` at {self.site}"


@dataclass(frozen=True)
class _Root:
    """A parameter or buffer of the full model at the end of ``configure_model``."""

    name: str
    key: int
    #: whether the tensor is its storage's only content (offset 0, as many bytes): its replay needs no other tensor
    whole: bool


@dataclass
class InitRecording:
    """The operators ``configure_model`` ran on meta tensors, and the full model's parameters and buffers."""

    ops: list[_Op] = field(default_factory=list)
    roots: dict[str, _Root] = field(default_factory=dict)
    #: storage -> indices of the operators that create or write it
    writers: dict[int, list[int]] = field(default_factory=dict)
    #: whether :meth:`replay` replays PyTorch's default init (``reset_parameters()`` of ``torch.nn`` modules)
    defaults: bool = True
    #: storage of a plain copy of another root drawn at random -> that root (set after initialisation)
    copies: dict[int, _Root] = field(default_factory=dict)
    #: the global random streams when recording began: where one device's initialisation starts drawing
    streams: Streams | None = None

    def add(self, op: _Op) -> None:
        for key in op.writes | op.creates:
            self.writers.setdefault(key, []).append(len(self.ops))
        self.ops.append(op)

    def finish(self, module: nn.Module) -> InitRecording:
        """Name the storages after ``module``'s parameters and buffers (the first name of a tied one)."""
        tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        first: dict[int, str] = {}
        for name, t in tensors:
            if t is not None and t.is_meta:
                key = _key(t)
                first.setdefault(key, name)
                whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
                self.roots[name] = _Root(first[key], key, whole)
        return self

    def replay(self, network: nn.Module, prefix: str, seed: int, device: torch.device, *, defaults: bool = True) -> int:
        """Set ``network``'s allocated tensors (names under ``prefix`` in the full model) from their recorded
        operators; returns how many tensors had any. ``defaults=False`` leaves out what ``torch.nn`` modules'
        ``reset_parameters()`` did: a model with its own init hook (``_init_weights``) overrides PyTorch's defaults,
        and that hook then sets what nothing else did (transformers 5.x does not run it on the meta device)."""
        self.defaults = defaults
        done: set[int] = set()
        replayed = 0
        for name, tensor in [*network.named_parameters(), *network.named_buffers()]:
            root = self.roots.get(prefix + name)
            if root is None or root.key in done:
                continue
            done.add(root.key)
            needed = self._closure(root)
            if not needed or root.key in self.copies:
                continue
            if not root.whole:
                self._refuse_view(root, needed[0])
            replay = _Replay(self, {root.key: tensor}, device, needed)
            if not replay.replayable():
                continue  # left unset: the model's init hook sets it, or it is reported as missing
            seeded(seed, root.name, replay.run)
            replayed += 1
        return replayed

    def replay_in_order(self, network: nn.Module, prefix: str, device: torch.device, loaded: frozenset[str]) -> int:
        """One device's initialisation of ``network``'s allocated tensors: every recorded operator in recorded order,
        from the random streams as they were when recording began, which then stay where one device's end. The
        operators that set this rank's tensors (and what they read) run on them; the other random ones draw into a
        scratch tensor and are discarded. ``loaded``: names of tensors ``init_weights`` will load from a Hugging Face
        directory, whose draws are left out as ``from_pretrained`` leaves them out. Returns how many tensors had
        operators."""
        self.defaults = True  # one device runs torch.nn's reset_parameters() too
        skipped = {self.roots[n].key for n in loaded if n in self.roots}
        targets: dict[int, Tensor] = {}
        needed: set[int] = set()
        others: list[tuple[Tensor, int]] = []  # a tied tensor's other names, which `to_empty` allocated apart
        for name, tensor in [*network.named_parameters(), *network.named_buffers()]:
            root = self.roots.get(prefix + name)
            if root is not None and root.key in targets and targets[root.key] is not tensor:
                others.append((tensor, root.key))
            if root is None or root.key in targets or root.key in skipped:
                continue
            own = self._setting(root.key, len(self.ops), skip_empty=True)
            if not own:
                continue
            if not root.whole:
                self._refuse_view(root, own[0])
            self._refuse_loaded_reads(root, own, skipped)
            if not _Replay(self, {root.key: tensor}, device, own).replayable():
                continue  # left unset: the model's init hook sets it, or it is reported as missing
            targets[root.key] = tensor
            needed.update(own)
        assert self.streams is not None, "record_init captured the streams"
        drawn = self._drawn(skipped)
        self.streams.restore()
        run = _Replay(self, targets, device, sorted(needed), keep_generator=True)
        saved: dict[int, Tensor] = {}
        for index, op in enumerate(self.ops):
            if isinstance(op.func, StreamCall):  # a seed or fork_rng in configure_model, at its place
                op.func.replay(saved)
            elif index in needed:
                run.step(index)
            elif torch_compat.is_random(op.func) and (drawn is None or index in drawn):
                self._check_draws_by_shape(op)
                run.discard(op)
        for tensor, key in others:
            tensor.copy_(targets[key])
        return len(targets)

    def _drawn(self, loaded: set[int]) -> set[int] | None:
        """With tensors loaded from a Hugging Face directory, the operators one device's ``from_pretrained`` +
        the rest of ``configure_model`` run: those that set a tensor the directory does not hold (on any rank). The
        construction's draws for loaded tensors, and for tensors that end in none (a tied head's own weight before
        the tie), are not made (``from_pretrained`` builds under ``no_init_weights``). ``None``: every operator."""
        if not loaded:
            return None
        drawn: set[int] = set()
        for key in {r.key for r in self.roots.values()} - loaded:
            drawn.update(self._setting(key, len(self.ops), skip_empty=True))
        return drawn

    def _refuse_view(self, root: _Root, index: int) -> None:
        raise PipelineModelError(
            f"`{root.name}` is a view into a larger tensor created in `configure_model`, so its recorded"
            f" initialisation ({self.ops[index].describe()}) cannot be replayed on its own. Create it as"
            " a tensor of its own (`nn.Parameter(torch.empty(...))`)."
        )

    def _refuse_loaded_reads(self, root: _Root, needed: list[int], loaded: set[int]) -> None:
        """A tensor computed from one that ``init_weights`` loads would be computed from a value the load replaces."""
        names = {r.key: r.name for r in self.roots.values()}
        for index in needed:
            read = (self.ops[index].reads - self.ops[index].writes) & loaded
            if read:
                raise PipelineModelError(
                    f"The initialisation of `{root.name}` in `configure_model` reads `{names[min(read)]}`"
                    f" ({self.ops[index].describe()}), which `init_weights` loads afterwards, so it would be computed"
                    " from the value the load replaces. Compute it after the weights are loaded (in `on_fit_start`),"
                    " or load it too (`init_adapter`)."
                )

    def _check_draws_by_shape(self, op: _Op) -> None:
        if not torch_compat.draws_by_shape(op.func):
            raise PipelineModelError(
                f"`init_values='one_device'` replays every random draw of `configure_model` on every rank, drawing"
                f" other ranks' values into a scratch tensor, but {op.describe()} draws as many numbers as its"
                " inputs' values decide, which a rank that does not hold those tensors cannot know. Pass"
                " `init_values='per_unit'` to the strategy, or draw these values with `normal_`/`uniform_`."
            )

    def _closure(self, root: _Root) -> list[int]:
        """Indices of the operators that set ``root``'s values: its writers and, before each, the writers of what
        it reads (values as they were at that point), in recorded order. A creation that fills nothing (``empty``)
        sets no values of ``root``."""
        names = {r.key: r.name for r in self.roots.values()}
        needed = self._setting(root.key, len(self.ops), skip_empty=True)
        original = self._copied_from(root, needed)
        if original is not None:
            self.copies[root.key] = original
            return needed
        for index in needed:
            op = self.ops[index]
            for read in op.reads - op.writes - op.creates:  # another tensor's own operators read it too
                if read != root.key and read in names:
                    self._check_deterministic(root, names[read], read, index)
        return needed

    def _setting(self, key: int, before: int, skip_empty: bool = False) -> list[int]:
        """The operators before ``before`` that set storage ``key``'s values, with those of what they read."""
        needed: set[int] = set()
        pending = [(key, before)]
        while pending:
            current, limit = pending.pop()
            for index in self.writers.get(current, ()):
                op = self.ops[index]
                skipped = skip_empty and current == key and (_fills_nothing(op) or (op.default and not self.defaults))
                if index >= limit or index in needed or skipped:
                    continue
                needed.add(index)
                pending += [(read, index) for read in op.reads]
        return sorted(needed)

    def _copied_from(self, root: _Root, needed: list[int]) -> _Root | None:
        """The root that ``root`` is a plain copy of (one ``clone``/``copy_``/``_to_copy`` of it sets all of ``root``'s
        values), when that root's values are drawn at random and it is not written after the copy; else None."""
        own = [i for i in needed if root.key in self.ops[i].writes | self.ops[i].creates]
        if len(own) != 1 or not torch_compat.is_copy(self.ops[own[0]].func):
            return None
        out = self.ops[own[0]].outputs[0]  # the copy covers the whole tensor, not a slice of it
        if not root.whole or out.storage_offset() or out.numel() * out.element_size() != out.untyped_storage().nbytes():
            return None
        index = own[0]
        reads = self.ops[index].reads - {root.key}
        originals = [r for r in self.roots.values() if r.key in reads]
        if len(reads) != 1 or not originals or max(self.writers[originals[0].key]) > index:
            return None
        original = self.roots[originals[0].name]  # the first name of a tied one
        if not any(torch_compat.is_random(self.ops[i].func) for i in self._setting(original.key, index)):
            return None  # deterministic: replayed from its own operators like any value
        return original

    def copy_deferred(self, network: nn.Module, prefix: str) -> set[str]:
        """Give each plain copy of a root drawn at random (:meth:`_copied_from`) the value that root has now, after
        the replay and the model's init hook; returns the copies' names in ``network``. Refused when the original
        is not on this rank (another stage)."""
        tensors = {prefix + n: t for n, t in [*network.named_parameters(), *network.named_buffers()]}
        by_key = {r.key: n for n, r in self.roots.items() if n in tensors}
        copied = set()
        for name, tensor in tensors.items():
            root = self.roots.get(name)
            if root is None or root.key not in self.copies:
                continue
            original = self.copies[root.key]
            if original.key not in by_key:
                raise PipelineModelError(
                    f"`{root.name}` is initialised in `configure_model` as a copy of `{original.name}`, whose values"
                    " are drawn at random, but the two are on different pipeline stages, so this rank cannot copy"
                    f" it. Keep `{root.name}` and `{original.name}` in one unit (the same module), or initialise the"
                    " copy in `_init_weights(module)` / `reset_parameters()`."
                )
            tensor.copy_(tensors[by_key[original.key]])
            copied.add(name[len(prefix) :])
        return copied

    def _check_deterministic(self, root: _Root, other: str, key: int, reader: int) -> None:
        """Reading another parameter or buffer replays its operators too; refused when they draw random numbers: the
        other's own replay draws them from its own seed, so the two would disagree (``b.copy_(a)`` after
        ``a.normal_()``). Deterministic values (``original_inv_freq = inv_freq.clone()``) are recomputed."""
        drawn = [self.ops[i] for i in self._setting(key, reader) if torch_compat.is_random(self.ops[i].func)]
        if drawn:
            raise PipelineModelError(
                f"The initialisation of `{root.name}` in `configure_model` reads `{other}`"
                f" ({self.ops[reader].describe()}), whose values are drawn at random ({drawn[-1].describe()}): each"
                " rank replays a parameter's initialisation under that parameter's own seed, so the two would"
                " disagree. Share the Parameter itself (tied weights), or initialise it in `_init_weights(module)` /"
                " `reset_parameters()`."
            )


def _fills_nothing(op: _Op) -> bool:
    return bool(op.creates) and not op.writes and torch_compat.fills_nothing(op.func)


class _Replay:
    """Re-runs recorded operators with each meta tensor replaced by its real counterpart on ``device``: ``targets``
    (storage -> an allocated tensor laid out as the meta storage), or what an earlier operator created."""

    def __init__(
        self,
        recording: InitRecording,
        targets: dict[int, Tensor],
        device: torch.device,
        indices: list[int],
        *,
        keep_generator: bool = False,
    ) -> None:
        self.recording, self.targets, self.device, self.indices = recording, targets, device, indices
        self.keep_generator = keep_generator
        self.bases: dict[int, Tensor] = dict(targets)  # storage -> a real tensor laid out as the meta storage
        self.real: dict[int, Tensor] = {}  # id of a recorded output -> its real value
        self.outputs: dict[int, list[int]] = {}  # storage -> ids of its recorded outputs in `real`
        self.last: dict[int, int] = {}  # storage -> the last of `indices` that touches it
        for index in indices:
            op = recording.ops[index]
            metas = [t for t in torch_compat.tensors_of((op.args, op.kwargs, op.outputs)) if t.is_meta]
            for key in op.reads | op.writes | op.creates | {_key(t) for t in metas}:
                self.last[key] = index
        self.scratch = torch.empty(0, dtype=torch.uint8, device=device)

    def replayable(self) -> bool:
        """Whether every meta tensor the operators read has recorded values: one made on the meta device by a call
        that no operator records (``torch.tensor(2.0)``, read by Gemma 3n's ``torch.rsqrt(torch.tensor(2.0))``)
        never had any."""
        known = set(self.targets)
        for index in self.indices:
            op = self.recording.ops[index]
            if any(t.is_meta and _key(t) not in known for t in torch_compat.tensors_of((op.args, op.kwargs))):
                return False
            known |= op.creates
        return True

    def run(self) -> None:
        for index in self.indices:
            self.step(index)

    def step(self, index: int) -> None:
        """Run operator ``index``; then let go of the temporaries no later one of ``indices`` needs."""
        op = self.recording.ops[index]
        args, kwargs = self._real(op.args), self._real(op.kwargs)
        if not self.keep_generator:
            kwargs.pop("generator", None)  # the parameter's own seed draws, whatever generator was recorded
        out = op.func(*args, **kwargs)
        outputs = torch_compat.tensors_of(out)
        for meta, real in zip(op.outputs, outputs):
            key = _key(meta)
            if key in self.targets:  # a target created by a value-setting operator (zeros, arange)
                self._view(meta).copy_(real)
            elif key in op.creates:
                self.bases.setdefault(key, real)
                self.real[id(meta)] = real
                self.outputs.setdefault(key, []).append(id(meta))
        for key in [k for k, last in self.last.items() if last == index and k not in self.targets]:
            self.bases.pop(key, None)
            for output in self.outputs.pop(key, ()):
                self.real.pop(output, None)

    def discard(self, op: _Op) -> None:
        """Draw what random operator ``op`` draws, into scratch tensors laid out as its meta tensors, and drop it:
        the random stream advances as on one device."""
        op.func(*self._scratch(op.args), **self._scratch(op.kwargs))

    def _scratch(self, value: Any) -> Any:
        if isinstance(value, Tensor) and value.is_meta:
            nbytes = value.untyped_storage().nbytes()
            if self.scratch.numel() < nbytes:
                self.scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            view = torch.empty(0, dtype=value.dtype, device=self.device)
            return view.set_(self.scratch.untyped_storage(), value.storage_offset(), value.size(), value.stride())
        if isinstance(value, torch.device) and value.type == "meta":
            return self.device
        if isinstance(value, (list, tuple)):
            return type(value)(self._scratch(v) for v in value)
        if isinstance(value, dict):
            return {k: self._scratch(v) for k, v in value.items()}
        return value

    def _real(self, value: Any) -> Any:
        if isinstance(value, Tensor):
            if not value.is_meta:
                return value.to(self.device)
            return self.real.get(id(value)) if id(value) in self.real else self._view(value)
        if isinstance(value, torch.device) and value.type == "meta":
            return self.device
        if isinstance(value, (list, tuple)):
            return type(value)(self._real(v) for v in value)
        if isinstance(value, dict):
            return {k: self._real(v) for k, v in value.items()}
        return value

    def _view(self, meta: Tensor) -> Tensor:
        """The real tensor with ``meta``'s place in its storage (``.data``, slices and views of a parameter)."""
        return self.bases[_key(meta)].as_strided(meta.size(), meta.stride(), meta.storage_offset())


def _record(recording: InitRecording, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """Record an operator that touched a meta tensor; views are not recorded (replay maps aliases by storage)."""
    inputs, outputs = torch_compat.tensors_of((args, kwargs)), torch_compat.tensors_of(out)
    if not any(t.is_meta for t in (*inputs, *outputs)):
        return
    written = frozenset(_key(t) for t in torch_compat.written_tensors(func, args, kwargs))
    if not written and torch_compat.returns_view(func):
        return
    reads = frozenset(_key(t) for t in inputs if t.is_meta) if torch_compat.reads_values(func) else frozenset()
    creates = frozenset() if written else frozenset(_key(t) for t in outputs)
    site, default = torch_compat.user_frame(__file__), bool(written) and torch_compat.in_default_init()
    recording.add(_Op(func, args, kwargs, written, creates, reads, list(outputs), site, default))


class _SkippedInits(TorchFunctionMode):
    """Records the ``nn.init`` functions that torch returns from at once on a meta tensor (``trunc_normal_``,
    ``orthogonal_``, ``dirac_``, ``sparse_``): seen as their check of ``tensor.is_meta``, with their arguments."""

    def __init__(self, recording: InitRecording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if out is True and torch_compat.is_meta_check(func):
            call = torch_compat.skipped_init_call()
            if call is not None:
                fn, tensor, arguments = call
                key = _key(tensor)
                site = torch_compat.user_frame(__file__)
                self.recording.add(_Op(fn, (tensor,), arguments, frozenset({key}), frozenset(), frozenset(), [], site))
        return out


def _stream_op(call: StreamCall, site: str) -> _Op:
    """A :class:`StreamCall` in the recorded order: it sets no tensor (only :meth:`InitRecording.replay_in_order`
    runs it)."""
    return _Op(call, (), {}, frozenset(), frozenset(), frozenset(), [], site)


@contextmanager
def record_init(device: torch.device | None = None) -> Iterator[InitRecording]:
    """Record what the enclosed code does to meta tensors (``configure_model`` under the strategy's meta device), and
    the random streams (CPU, and ``device``'s when it is a CUDA device) as they were when it began."""
    recording = InitRecording(streams=Streams.capture(device))
    with ExitStack() as stack:
        stack.enter_context(torch_compat.operator_observer(functools.partial(_record, recording)))
        stack.enter_context(_SkippedInits(recording))
        site = functools.partial(torch_compat.user_frame, __file__)
        stack.enter_context(stream_calls(lambda call: recording.add(_stream_op(call, site()))))
        yield recording
