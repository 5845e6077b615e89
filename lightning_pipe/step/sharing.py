"""One collective per step: the last stage's outcome (loss, logs, metric state changes, small outputs) to every rank.

An outcome is split into a *schema* (its structure: names, log options, tensor shapes and dtypes, list lengths) and
its *values* (every tensor and number, flattened into one float64 tensor). Steps of a run almost always share one
schema, so after the first step only the values travel, as a single tensor broadcast of known size. When the schema
changes (a new key is logged, a concatenating metric grows) a flag in that tensor says so and the schema and values
follow as one pickled object. float64 holds every float32/bfloat16/float16 value and every integer up to 2**53
exactly; larger integers send the outcome as an object instead.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch

from lightning_pipe.comm import collectives
from lightning_pipe.structures import NAMEDTUPLE_FIELDS

_EXACT_INT = 2**53


@dataclass(frozen=True)
class _TensorSlot:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _NumberSlot:
    kind: type


@dataclass(frozen=True)
class _SameTensor:
    """A tensor met before in the object (a step's loss is also its output): travels once, rebuilt as one object."""

    slot: int


class _Inexact(Exception):
    """A value float64 cannot carry exactly: the outcome goes as an object."""


def _flatten(obj: Any, values: list[Any], seen: dict[int, int]) -> Any:
    """The schema of ``obj``; its tensors and numbers are appended to ``values`` (``seen``: the slot of each tensor
    appended, by ``id``)."""
    if obj is None or isinstance(obj, (bool, str)):  # the most common leaves first: flattened once a step
        return obj
    if isinstance(obj, torch.Tensor):
        slot = seen.get(id(obj))
        if slot is not None:
            return _SameTensor(slot)
        if obj.is_complex() or (
            not obj.is_floating_point() and obj.dtype != torch.bool and obj.numel() and _too_large(obj)
        ):
            raise _Inexact
        seen[id(obj)] = len(values)
        values.append(obj.detach())
        return _TensorSlot(tuple(obj.shape), obj.dtype)
    if isinstance(obj, (int, float)):
        if isinstance(obj, int) and abs(obj) > _EXACT_INT:
            raise _Inexact
        values.append(obj)
        return _NumberSlot(type(obj))
    if isinstance(obj, (list, tuple)) and not obj:
        return (type(obj), ())
    names = _field_names(type(obj))
    if names is not None:  # (a list, not a generator: an outcome is flattened at every step)
        return (type(obj), tuple([(name, _flatten(getattr(obj, name), values, seen)) for name in names]))
    if isinstance(obj, Mapping):
        return (type(obj), tuple((k, _flatten(v, values, seen)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj), tuple(_flatten(v, values, seen) for v in obj))
    return obj  # anything else travels in the schema (pickled when the schema changes)


@functools.lru_cache(maxsize=256)
def _field_names(kind: type) -> tuple[str, ...] | None:
    """The field names of the dataclass ``kind`` (``None`` for any other type); cached: read on every step."""
    return tuple(f.name for f in dataclasses.fields(kind)) if dataclasses.is_dataclass(kind) else None


def _too_large(t: torch.Tensor) -> bool:
    return bool(t.abs().max() > _EXACT_INT)


#: tensors up to this many elements on the CPU travel as Python floats gathered into the one values tensor (fewer
#: tensor operations per step than a conversion and a piece to concatenate each)
_GATHERED = 16
#: received values up to this many are read as Python floats once (:class:`_Reader`)
_READ_AS_NUMBERS = 256


def _pack_values(values: list[Any], device: torch.device, flag: float | None = None) -> torch.Tensor:
    """``values`` as one float64 tensor on ``device``, after ``flag`` where given (the header's first element).

    Numbers and small CPU tensors are read as Python floats: exact, like the conversion to float64 (a float64 holds
    every float32, float16 and bfloat16 value, and the integers up to 2**53 :func:`_flatten` lets through)."""
    parts: list[torch.Tensor] = []
    floats: list[Any] = [] if flag is None else [flag]
    for v in values:
        if not isinstance(v, torch.Tensor):
            floats.append(float(v))
        elif v.device.type == "cpu" and v.numel() <= _GATHERED:
            if v.dim() == 0:
                floats.append(v.item())
            else:
                floats.extend(v.reshape(-1).tolist())
        else:
            if floats:
                parts.append(torch.tensor(floats, dtype=torch.float64, device=device))
                floats = []
            parts.append(v.reshape(-1).to(device=device, dtype=torch.float64))
    if floats or not parts:
        parts.append(torch.tensor(floats, dtype=torch.float64, device=device))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _Reader:
    """The values of one message, read in the order they were flattened: from ``flat`` from ``offset`` on, or from
    ``numbers`` (``flat`` as Python floats, where it is small and on the CPU: a scalar is then made in one tensor
    operation, not a slice, a reshape and a conversion; the same value, since each came exactly from its dtype)."""

    __slots__ = ("flat", "offset", "device", "numbers", "made")

    def __init__(self, flat: torch.Tensor, offset: int, device: torch.device, numbers: list | None) -> None:
        self.flat, self.offset, self.device, self.numbers = flat, offset, device, numbers
        #: every slot's value so far, in the order the values were flattened (what a :class:`_SameTensor` names)
        self.made: list[Any] = []

    def tensor(self, slot: _TensorSlot) -> torch.Tensor:
        n = 1
        for d in slot.shape:
            n *= d
        start = self.offset
        self.offset += n
        if self.numbers is not None and not slot.shape:  # (scalar_tensor: torch.tensor's value at half its CPU)
            value = torch.scalar_tensor(self.numbers[start], dtype=slot.dtype, device=self.device)
        else:
            value = self.flat[start : start + n].reshape(slot.shape).to(device=self.device, dtype=slot.dtype)
        self.made.append(value)
        return value

    def number(self, slot: _NumberSlot) -> Any:
        number = self.numbers[self.offset] if self.numbers is not None else float(self.flat[self.offset])
        self.offset += 1
        value = slot.kind(number) if slot.kind is not float else number
        self.made.append(value)
        return value


#: ``decode(reader) -> object``: a schema compiled once (:func:`_decoder`)
Decoder = Callable[[_Reader], Any]


def _decoder(schema: Any) -> Decoder:
    """The function that rebuilds ``schema``'s object from a :class:`_Reader`: the schema is walked once, when it
    arrives, not at every step that sends values only."""
    if isinstance(schema, _TensorSlot):
        return lambda reader: reader.tensor(schema)
    if isinstance(schema, _SameTensor):
        slot = schema.slot
        return lambda reader: reader.made[slot]
    if isinstance(schema, _NumberSlot):
        return lambda reader: reader.number(schema)
    if isinstance(schema, tuple) and len(schema) == 2 and isinstance(schema[0], type):
        kind, items = schema
        if not items and (kind is list or kind is tuple):
            return lambda reader: kind()
        if not issubclass(kind, (list, tuple)) or _field_names(kind) is not None:
            parts = [(k, _decoder(v)) for k, v in items]  # (name, schema) pairs: a dataclass's fields, a mapping's
        else:
            decoders = [_decoder(v) for v in items]
            if hasattr(kind, NAMEDTUPLE_FIELDS):
                return lambda reader: kind(*[d(reader) for d in decoders])
            return lambda reader: kind(d(reader) for d in decoders)
        if _field_names(kind) is not None:
            # fields that hold no value (None, flags, names) given as they are; the others read in order
            fixed = {k: v for k, v in items if v is None or isinstance(v, (bool, str))}
            read = [(k, d) for k, d in parts if k not in fixed]
            return lambda reader: kind(**fixed, **{k: d(reader) for k, d in read})
        if kind is dict:
            return lambda reader: {k: d(reader) for k, d in parts}
        return lambda reader: kind({k: d(reader) for k, d in parts})
    return lambda reader: schema  # None, a flag, a name, or anything else that travels in the schema


def flatten(obj: Any) -> tuple[Any, list[Any]]:
    """``(schema, values)`` of ``obj``; raises nothing (an inexact value makes the schema ``None``)."""
    values: list[Any] = []
    try:
        return _flatten(obj, values, {}), values
    except _Inexact:
        return None, []


def rebuild(schema: Any, flat: torch.Tensor, device: torch.device, offset: int = 0) -> Any:
    """The object of ``schema`` with its values read from ``flat`` from ``offset`` on."""
    return _decoder(schema)(_Reader(flat, offset, device, _numbers(flat)))


def _numbers(flat: torch.Tensor) -> list[float] | None:
    """``flat`` as Python floats where it is small and on the CPU, else ``None``."""
    return flat.tolist() if flat.device.type == "cpu" and flat.numel() <= _READ_AS_NUMBERS else None


class OutcomeChannel:
    """Sends an object from one rank of a group to the others, sending only values while the schema holds.

    Every rank of ``group`` calls :meth:`expect` when a step starts and :meth:`share` once per step, in the same
    order; ``src`` is the sending global rank.

    While the schema holds, the values travel point to point on CPU groups: each receiver posts its receive in
    :meth:`expect` (before the step, or inside a training schedule where the rank first waits for another), so when
    the sender finishes its step first (the last stage usually does) the values are already there when the receiver
    asks, and no rank waits for the other in a collective. Elsewhere (NCCL) they are one tensor broadcast.
    """

    def __init__(self, group: Any, src: int, device: torch.device) -> None:
        self.group, self.src = group, src
        self.device = collectives.served_device(group, device)
        self.local_device = device
        self._schema: Any = None
        self._decode: Decoder = _decoder(None)
        self._size: int | None = None
        #: values point to point (a tag of their own, apart from the schedule's messages), else a broadcast
        self.point_to_point = self.device.type == "cpu"
        self._receive: tuple[Any, torch.Tensor] | None = None
        self._sends: list[tuple[Any, torch.Tensor]] = []
        #: how many steps needed the object path (tests and benchmarks read it)
        self.object_steps = 0
        # Read once: a channel lives within one Trainer entry, on one process group.
        self._alone = collectives.group_size(group) == 1
        self._sender = collectives.world_rank() == src
        #: the ranks a sender sends the values to (found on its first send)
        self._others: list[int] | None = None
        self._direct = collectives.Direct(group) if self.point_to_point and not self._alone else None
        #: whether :meth:`expect` posts anything on this rank (a point-to-point receiver): where not, a step need not
        #: tell the channel where it first waits
        self.receives = self._direct is not None and not self._sender

    def expect(self) -> None:
        """A step starts: a receiver posts the receive of the step's values (when their size is known)."""
        if not self.point_to_point or self._size is None or self._receive is not None or self._alone or self._sender:
            return
        buffer = torch.empty(self._size + 1, dtype=torch.float64, device=self.device)
        self._receive = self._direct.irecv(buffer, self.src, VALUES_TAG)

    def share(self, obj: Any) -> Any:
        """``obj`` as sent by ``src``; ``obj`` is ignored on the other ranks."""
        if self._alone:
            return obj
        sender = self._sender
        schema, values = flatten(obj) if sender else (None, [])
        same = sender and schema is not None and schema == self._schema
        if self._size is not None:
            header: torch.Tensor | None = None
            if same:
                header = _pack_values(values, self.device, flag=1.0)
            elif sender or not self.point_to_point:
                header = torch.zeros(self._size + 1, dtype=torch.float64, device=self.device)
            # (a receiver's values arrive in the buffer it posted in expect())
            header = self._values(header, sender)
            if sender:
                if same:
                    return obj
            else:
                # the flag and the values read as Python numbers at once where they are few and on the CPU
                numbers = _numbers(header)
                if (numbers[0] if numbers is not None else float(header[0])) == 1.0:
                    return self._decode(_Reader(header, 1, self.local_device, numbers))
        # The schema changed (or this is the first step): schema and values as one object.
        self.object_steps += 1
        payload = (schema, _pack_values(values, torch.device("cpu")), obj if schema is None else None)
        schema, flat, whole = collectives.broadcast_object(
            payload if sender else None, self.src, self.group, self.device
        )
        if schema is None:
            self._schema, self._size = None, None
            return obj if sender else whole
        self._schema, self._size = schema, int(flat.numel())
        if sender:
            return obj
        self._decode = _decoder(schema)
        return self._decode(_Reader(flat, 0, self.local_device, _numbers(flat)))

    def _values(self, header: torch.Tensor | None, sender: bool) -> torch.Tensor:
        """The sender's ``header`` (flag, then values) on every rank (``None`` on a point-to-point receiver)."""
        if not self.point_to_point:
            assert header is not None
            return collectives.broadcast_(header, self.src, self.group)
        if sender:
            assert header is not None
            self._send(header)
            return header
        self.expect()  # posted earlier in the step (before it, or where a schedule first waited), unless not
        receive, self._receive = self._receive, None
        assert receive is not None
        collectives.wait([receive])
        return receive[1]

    def close(self) -> None:
        """Wait for this rank's sends in flight (their receivers already have them): none is left when the channel
        goes, e.g. at the end of a Trainer entry."""
        collectives.wait(self._sends)
        self._sends = []

    def _send(self, header: torch.Tensor) -> None:
        # The previous step's sends completed long ago (their receivers used them); waiting keeps them bounded.
        collectives.wait(self._sends)
        if self._others is None:
            self._others = [r for r in collectives.group_ranks(self.group) if r != self.src]
        self._sends = [self._direct.isend(header, r, VALUES_TAG) for r in self._others]


#: tag of the outcome values' point-to-point messages (torch's schedules and the evaluation pass send with tag 0)
VALUES_TAG = 0x0C0
