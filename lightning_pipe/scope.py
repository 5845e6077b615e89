"""Installing something on a user's object for one Trainer entry, and undoing it after: context managers the strategy
enters into the exit stack it closes at teardown, so nothing it installs outlives its Trainer."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from typing import Any


@contextmanager
def replaced(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.name`` is ``value`` inside the block (an instance attribute shadowing the class's), as before after."""
    had = name in vars(obj)
    before = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, before)
        else:
            delattr(obj, name)


@contextmanager
def ignoring(message: str, category: type[Warning]) -> Iterator[None]:
    """One ``warnings`` filter that ignores ``message`` inside the block and is removed after it (filters others add
    meanwhile are kept, unlike ``warnings.catch_warnings``)."""
    warnings.filterwarnings("ignore", message=message, category=category)
    entry = warnings.filters[0]
    try:
        yield
    finally:
        with suppress(ValueError):
            warnings.filters.remove(entry)


#: Lightning's advice (a PossibleUserWarning) to pass `sync_dist=True` for values logged on epoch level.
SYNC_DIST_ADVICE = r"It is recommended to use `self\.log\(.*sync_dist=True\)`"


@contextmanager
def quieter_warnings(global_rank: int, replicated: bool) -> Iterator[None]:
    """Warnings that say nothing under a pipeline, silenced inside the block: without data-parallel replicas,
    Lightning's advice to sync logged values across devices (every rank logs the same values of one batch); on ranks
    other than 0, libraries' deprecation notices (the same on every rank: rank 0 shows them once)."""
    from lightning.pytorch.utilities.warnings import PossibleUserWarning

    with ExitStack() as stack:
        if not replicated:
            stack.enter_context(ignoring(SYNC_DIST_ADVICE, PossibleUserWarning))
        if global_rank != 0:
            for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
                stack.enter_context(ignoring("", category))
        yield
