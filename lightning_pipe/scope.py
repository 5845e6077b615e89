"""Installing something on a user's object for one Trainer entry, and undoing it after: context managers the strategy
enters into the exit stack it closes at teardown, so nothing it installs outlives its Trainer."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
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
