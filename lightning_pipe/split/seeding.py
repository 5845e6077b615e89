"""The random streams a split network's initial values are drawn from.

``init_values="per_unit"``: the seed of each module or unit, ``seed + crc32(name)``, so its initial values depend on
its name in the full model only, not on the pipeline layout or on which rank holds it; the model's own init hooks
(:mod:`lightning_pipe.split.initialization`) always draw under these seeds. ``init_values="one_device"``: the global
streams as they were when ``configure_model`` began (:class:`Streams`), replayed in one device's order
(:mod:`lightning_pipe.split.deferred_init`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


def unit_seed(seed: int, name: str) -> int:
    """The seed of the module or unit called ``name``."""
    return (seed + zlib.crc32(name.encode())) % (2**63)


def seeded(seed: int, name: str, fn: Callable[[], Any]) -> None:
    """Run ``fn`` with torch's random stream seeded by :func:`unit_seed`, restoring the stream afterwards."""
    # The accelerator's generator is restored too: initialisation must not shift the random stream of training.
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(unit_seed(seed, name))
        fn()


@dataclass(frozen=True)
class Streams:
    """The global random streams at one moment: the CPU generator's state and, for a CUDA ``device``, that device's."""

    cpu: torch.Tensor
    device: torch.device | None = None
    accelerator: torch.Tensor | None = None

    @classmethod
    def capture(cls, device: torch.device | None = None) -> Streams:
        if device is not None and device.type == "cuda":
            return cls(torch.get_rng_state(), device, torch.cuda.get_rng_state(device))
        return cls(torch.get_rng_state())

    def restore(self) -> None:
        """Set the streams back to this state: what is drawn next is what was drawn next then."""
        torch.set_rng_state(self.cpu)
        if self.accelerator is not None:
            torch.cuda.set_rng_state(self.accelerator, self.device)


@dataclass(frozen=True)
class StreamCall:
    """A call that moved the CPU stream while ``configure_model`` was recorded, replayed at its place in one device's
    order: ``torch.manual_seed(value)`` (``"seed"``), ``torch.get_rng_state()`` (``"save"``, ``value`` the state's
    key), ``torch.set_rng_state`` of a state saved so (``"restore"``) or of another state (``"set"``)."""

    kind: str
    value: Any

    def replay(self, saved: dict[int, torch.Tensor]) -> None:
        if self.kind == "seed":
            torch.manual_seed(self.value)
        elif self.kind == "save":
            saved[self.value] = torch.get_rng_state()
        else:
            torch.set_rng_state(saved[self.value] if self.kind == "restore" else self.value)


@contextmanager
def stream_calls(record: Callable[[StreamCall], None]) -> Iterator[None]:
    """Inside, ``torch.manual_seed``, ``torch.get_rng_state`` and ``torch.set_rng_state`` (as ``torch.random.fork_rng``
    and ``seed_everything`` call them) run as usual and are passed to ``record`` as :class:`StreamCall` s."""
    import torch.random as random

    seed, get, set_ = random.manual_seed, random.get_rng_state, random.set_rng_state
    states: dict[int, torch.Tensor] = {}  # the states handed out, kept alive so that their ids stay theirs

    def manual_seed(value: int) -> Any:
        out = seed(value)
        record(StreamCall("seed", int(value)))
        return out

    def get_rng_state() -> torch.Tensor:
        state = get()
        states[id(state)] = state
        record(StreamCall("save", id(state)))
        return state

    def set_rng_state(new_state: torch.Tensor) -> None:
        set_(new_state)
        saved = states.get(id(new_state)) is new_state
        record(StreamCall("restore", id(new_state)) if saved else StreamCall("set", new_state.clone()))

    patched = {"manual_seed": manual_seed, "get_rng_state": get_rng_state, "set_rng_state": set_rng_state}
    originals = {name: (getattr(torch, name), getattr(random, name)) for name in patched}
    for name, fn in patched.items():
        setattr(torch, name, fn)
        setattr(random, name, fn)
    try:
        yield
    finally:
        for name, (top, inner) in originals.items():
            setattr(torch, name, top)
            setattr(random, name, inner)
