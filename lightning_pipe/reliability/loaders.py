"""Training data that resumes where it stopped: the position inside the epoch, the epoch's order, and the moment the
random streams are taken and given back.

Lightning keeps the training loop's counters in a checkpoint, and the state of a loader that has ``state_dict``; an
ordinary ``DataLoader`` has none, so a mid-epoch resume starts the epoch's data again, and a ``shuffle=True`` loader
draws another order. The strategy stands a :class:`ResumableLoader` in for each training loader
(``Strategy.process_dataloader``):

- its iterator is created at the first batch request of each epoch, not when Lightning calls ``iter()`` (which a
  resumed run calls at another point of its hooks than an uninterrupted one), so the draws that fix an epoch (the
  loader's base seed, a ``RandomSampler``'s seed) happen at the same point in both;
- a :class:`ResumableSampler` around the index sampler (the ``DataLoader`` is re-created around it, as Lightning does
  to add a ``DistributedSampler``) primes the epoch's order at that point and skips indices without loading data;
- :class:`Continuation` is where a checkpoint's *resume point* is taken: at the next batch request after a save
  (every random stream of this rank, and each loader's generator states at its epoch's start), and given back in the
  resumed run at that same batch request: mid-epoch, the epoch's start states are set, its order is drawn again and
  the batches already trained on are skipped, then the streams are restored; at an epoch boundary, the streams are
  restored and the new epoch starts.

A loader that cannot be replayed by index (an ``IterableDataset``, a batch sampler of the user's) is stood in for by a
:class:`PassLoader`, which takes the resume point but is not resumable itself: Lightning's own warning about a
mid-epoch resume of a loader without ``state_dict`` stays; a loader with its own ``state_dict`` (torchdata's
``StatefulDataLoader``) keeps it. See docs/reliability.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from lightning_pipe.compat import lightning as pl_compat

_END = object()
#: A :class:`ResumableLoader`'s ``state_dict`` (it marks the loader resumable for Lightning; the position is elsewhere)
LOADER_STATE = {"lightning_pipe": 1}


def _generator_state(obj: Any) -> Optional[torch.Tensor]:
    generator = getattr(obj, "generator", None)
    return generator.get_state() if isinstance(generator, torch.Generator) else None


def _set_generator_state(obj: Any, state: Optional[torch.Tensor]) -> None:
    generator = getattr(obj, "generator", None)
    if state is not None and isinstance(generator, torch.Generator):
        generator.set_state(state)


@dataclass(frozen=True)
class EpochStart:
    """The random states an epoch of one loader was drawn from: torch's global CPU generator, and the loader's and its
    sampler's own generators when they have one."""

    global_state: torch.Tensor
    loader_generator: Optional[torch.Tensor] = None
    sampler_generator: Optional[torch.Tensor] = None

    def as_dict(self) -> dict[str, Optional[torch.Tensor]]:
        return {"global": self.global_state, "loader": self.loader_generator, "sampler": self.sampler_generator}

    @classmethod
    def from_dict(cls, data: dict[str, Optional[torch.Tensor]]) -> EpochStart:
        return cls(data["global"], data.get("loader"), data.get("sampler"))  # type: ignore[arg-type]


class ResumableSampler(Sampler):
    """An index sampler whose epoch order is drawn when :meth:`prime` is called, and that skips the first indices of
    an epoch on request (``set_epoch`` is passed on, for a ``DistributedSampler``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._iterator: Optional[Iterator[Any]] = None
        self._first: list[Any] = []
        self._skip = 0

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.inner, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def new_epoch(self, skip: int = 0) -> None:
        """The next iteration is a new epoch that starts after its first ``skip`` indices."""
        self._iterator, self._first, self._skip = None, [], skip

    def prime(self) -> None:
        """Draw this epoch's order now (a ``RandomSampler`` draws its seed at its first index) and skip what was
        asked; idempotent within an epoch."""
        if self._iterator is not None:
            return
        self._iterator = iter(self.inner)
        for _ in range(self._skip):
            if next(self._iterator, _END) is _END:
                break
        first = next(self._iterator, _END)
        self._first = [] if first is _END else [first]

    def __iter__(self) -> Iterator[Any]:
        # The epoch starts at the first index asked for, as a generator's would; its indices then come from the inner
        # sampler's iterator directly (a generator of ours in between cost a Python call per sample, every step).
        return itertools.chain.from_iterable(self._epoch())

    def _epoch(self) -> Iterator[Iterator[Any]]:
        self.prime()
        iterator, first = self._iterator, self._first
        self.new_epoch()
        yield iter(first)
        yield iterator  # type: ignore[misc]


class Continuation:
    """Where resume points are taken and given back, for the training loaders of one Trainer entry.

    ``capture`` returns this rank's random streams, ``restore`` sets them; ``batches_done`` is how many batches of
    the current epoch the training loop has already had (Lightning's ``batch_progress.current.ready``, restored from
    a checkpoint on resume).
    """

    def __init__(
        self,
        capture: Callable[[], dict[str, Any]],
        restore: Callable[[dict[str, Any]], None],
        batches_done: Callable[[], int],
    ) -> None:
        self._capture, self.restore, self._batches_done = capture, restore, batches_done
        self.loaders: list[PassLoader] = []
        self._waiting: list[Callable[[dict[str, Any]], None]] = []
        self._resume: Optional[dict[str, Any]] = None

    def point(self) -> dict[str, Any]:
        """This rank's resume point now: its random streams and each loader's current epoch start."""
        starts = [loader.epoch_start.as_dict() if loader.epoch_start else None for loader in self.loaders]
        return {"streams": self._capture(), "epoch_starts": starts}

    def when_training_continues(self, callback: Callable[[dict[str, Any]], None]) -> None:
        """Call ``callback`` with the resume point at the next training batch request (or :meth:`flush`)."""
        self._waiting.append(callback)

    @property
    def waiting(self) -> bool:
        return bool(self._waiting)

    def flush(self) -> None:
        """Hand the resume point to every waiting callback now (before the next batch, or at the end of training)."""
        if self._waiting:
            waiting, self._waiting = self._waiting, []
            point = self.point()
            for callback in waiting:
                callback(point)

    def resume_from(self, point: Optional[dict[str, Any]]) -> None:
        """Give ``point`` back at the next training batch request (``None``: nothing to give back)."""
        self._resume = point

    def take_resume(self, loader: PassLoader) -> Optional[tuple[dict[str, Any], Optional[EpochStart], int]]:
        """The resume point, this loader's epoch start in it, and the batches to skip (once per loader)."""
        if self._resume is None or loader.resumed:
            return None
        loader.resumed = True
        starts = self._resume.get("epoch_starts") or []
        start = starts[loader.index] if loader.index < len(starts) and starts[loader.index] else None
        return self._resume, EpochStart.from_dict(start) if start else None, self._batches_done()


class PassLoader:
    """Stands in for a training loader: passes everything through, and makes its iterator at the first batch request
    of an epoch, where resume points are taken and given back."""

    _OWN = frozenset({"loader", "continuation", "index", "epoch_start", "resumed", "index_sampler"})

    def __init__(self, loader: Any, continuation: Continuation) -> None:
        object.__setattr__(self, "loader", loader)
        object.__setattr__(self, "continuation", continuation)
        object.__setattr__(self, "index", len(continuation.loaders))
        object.__setattr__(self, "epoch_start", None)
        object.__setattr__(self, "resumed", False)
        continuation.loaders.append(self)

    # Lightning reads and sets the loader's attributes (sampler, batch_size, worker_init_fn, _iterator, ...).
    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return _EpochIterator(self)

    def begin_epoch(self) -> Iterator[Any]:
        """Called at the first batch request of an epoch: resume points first, then the epoch's iterator."""
        self.continuation.flush()
        resume = self.continuation.take_resume(self)
        if resume is not None:
            point, _start, _done = resume
            self.continuation.restore(point["streams"])
        return iter(self.loader)


class StatefulPassLoader(PassLoader):
    """A pass-through stand-in for a loader with its own ``state_dict`` (torchdata's ``StatefulDataLoader``), which
    Lightning saves and restores through this object."""

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


class ResumableLoader(PassLoader):
    """A ``DataLoader`` with a :class:`ResumableSampler`: resumes mid-epoch at the batch it stopped at, with the
    epoch's order. Its ``state_dict`` is what tells Lightning that it is resumable (the resume point itself is kept
    per rank with the checkpoint)."""

    def __init__(self, loader: DataLoader, sampler: ResumableSampler, continuation: Continuation) -> None:
        super().__init__(loader, continuation)
        object.__setattr__(self, "index_sampler", sampler)

    def state_dict(self) -> dict[str, Any]:
        return dict(LOADER_STATE)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass  # the position is the training loop's own count, the random states are in the resume point

    def begin_epoch(self) -> Iterator[Any]:
        self.continuation.flush()
        resume = self.continuation.take_resume(self)
        if resume is not None:
            point, start, done = resume
            if done > 0 and start is not None:  # mid-epoch: the epoch again from its start states, then skip
                iterator = self._start_epoch(start, skip=done)
                self.continuation.restore(point["streams"])
                return iterator
            self.continuation.restore(point["streams"])
        sampler = self.index_sampler.inner
        start = EpochStart(torch.get_rng_state(), _generator_state(self.loader), _generator_state(sampler))
        return self._start_epoch(start, skip=0)

    def _start_epoch(self, start: EpochStart, skip: int) -> Iterator[Any]:
        torch.set_rng_state(start.global_state)
        _set_generator_state(self.loader, start.loader_generator)
        _set_generator_state(self.index_sampler.inner, start.sampler_generator)
        object.__setattr__(self, "epoch_start", start)
        self.index_sampler.new_epoch(skip * self.loader.batch_size)
        iterator = iter(self.loader)  # the loader's base seed, as torch draws it
        self.index_sampler.prime()  # then the order (a worker-process iterator primed it already)
        return iterator


class _EpochIterator:
    def __init__(self, owner: PassLoader) -> None:
        self.owner = owner
        self.iterator: Optional[Iterator[Any]] = None

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        if self.iterator is None:
            self.iterator = self.owner.begin_epoch()
        elif self.owner.continuation.waiting:
            self.owner.continuation.flush()
        return next(self.iterator)


def replayable(loader: Any) -> bool:
    """Whether ``loader`` is a map-style ``DataLoader`` batched by torch's own ``BatchSampler`` (fixed batch size):
    then an epoch position is a count of indices, skippable without loading data."""
    return (
        isinstance(loader, DataLoader)
        and not isinstance(loader.dataset, IterableDataset)
        and type(loader.batch_sampler) is BatchSampler
        and loader.batch_size is not None
    )


def stand_in(loader: Any, continuation: Continuation) -> PassLoader:
    """The stand-in for training loader ``loader``: its own state kept when it has one, resumable when
    :func:`replayable`, else pass-through."""
    if callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)):
        return StatefulPassLoader(loader, continuation)
    if replayable(loader):
        sampler = ResumableSampler(loader.sampler)
        try:
            copy = pl_compat.training_dataloader_with(loader, sampler)
        except MisconfigurationException:  # a DataLoader subclass Lightning cannot make again: not replayable
            return PassLoader(loader, continuation)
        return ResumableLoader(copy, sampler, continuation)
    return PassLoader(loader, continuation)
