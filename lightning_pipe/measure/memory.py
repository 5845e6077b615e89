"""Memory per rank, measured: model state, activations saved for backward, and peak during a block of code.

Three figures answer "will this layout fit":

- :func:`state_bytes`: parameters, gradients and optimizer state a rank holds (each storage counted once, so tied
  or viewed tensors are not counted twice);
- :class:`SavedTensorBytes` / :func:`saved_bytes`: bytes autograd keeps for backward during a forward, which a
  stage holds once per microbatch in flight (what activation checkpointing reduces);
- :class:`PeakMemory`: the most bytes allocated at once during a block of code, e.g. model construction.

On CUDA the peak is the caching allocator's ``max_memory_allocated``. torch has no CPU allocator statistics (torch
2.13: ``torch.accelerator.memory_stats`` refuses the CPU, ``torch.cpu`` has none), so on the CPU the peak is
counted from the tensors themselves: a dispatch mode sees every tensor an operator returns and a finaliser on its
storage sees it freed. That counts exactly what torch allocates (the figure that matches ``max_memory_allocated``),
not the Python heap or the allocator's slack; the process's peak resident set (Linux ``VmHWM``, reset through
``/proc/self/clear_refs``) is reported beside it where the kernel allows.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from lightning_pipe.compat import torch as torch_compat
from lightning_pipe.structures import is_dtensor, tensors_in


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``512 B``, ``3.0 KiB``, ``1.50 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    s = t.untyped_storage()
    if t.device.type == "meta":
        # Meta storages all have address 0; the storage object itself is kept alive by the caller while it counts.
        return ("meta", id(s))
    if torch_compat.is_fake(t):  # its storage has no data: asking for its address warns (deprecated)
        return ("fake", torch_compat.storage_identity(s))
    return (t.device, s.data_ptr())


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[tuple[Any, ...], int] = {}
    for t in tensors:
        # A DTensor (FSDP) counts what this rank holds: its local shard.
        t = t.to_local() if hasattr(t, "to_local") else t
        seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


# ------------------------------------------------------------------------------------------------ model state
@dataclass(frozen=True)
class StateBytes:
    """Bytes of model state one rank holds."""

    parameters: int
    """Parameters and buffers of the rank's stages."""
    gradients: int
    """``.grad`` of those parameters (0 before the first backward)."""
    optimizer_state: int
    """Tensors in the optimizers' ``state`` (e.g. Adam's two moments and step)."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    def report(self, rank: int, stages: Sequence[int]) -> str:
        """One line for the log: rank, stages and each figure."""
        return (
            f"rank {rank} stages {list(stages)}: parameters {format_bytes(self.parameters)}, gradients"
            f" {format_bytes(self.gradients)}, optimizer state {format_bytes(self.optimizer_state)}, total"
            f" {format_bytes(self.total)}"
        )


def state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> StateBytes:
    """Parameter (and buffer), gradient and optimizer-state bytes of ``module`` and ``optimizers``.

    Optimizer state is walked from ``optimizer.state``, so it counts only what the optimizer has created (Adam
    creates its moments at the first ``step``).
    """
    params = list(module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [
        value
        for optimizer in optimizers
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    ]
    return StateBytes(
        parameters=_unique_bytes([*params, *module.buffers()]),
        gradients=_unique_bytes(grads),
        optimizer_state=_unique_bytes(state),
    )


def split_parameter_bytes(module: nn.Module, axis: str) -> int:
    """Bytes of ``module``'s parameters this rank holds as its shard of a DTensor split over mesh ``axis`` (e.g.
    ``"tp"``), each storage once."""
    split = []
    for p in module.parameters():
        if is_dtensor(p):
            names = tuple(p.device_mesh.mesh_dim_names or ())  # type: ignore[attr-defined]
            if any(n == axis and not pl.is_replicate() for n, pl in zip(names, p.placements)):  # type: ignore[attr-defined]
                split.append(p)
    return _unique_bytes(split)


def tensor_parallel_share(module: nn.Module, rank: int, size: int) -> tuple[int, int, int] | None:
    """``(rank, size, bytes)`` of a :class:`MemoryReport`'s ``tensor_parallel``: the bytes of this rank's shards of
    parameters split over the ``"tp"`` axis; ``None`` without tensor parallelism (``size`` 1)."""
    return (rank, size, split_parameter_bytes(module, "tp")) if size > 1 else None


# ------------------------------------------------------------------------------------------ saved for backward
def _storage_key_or_none(t: torch.Tensor) -> tuple[Any, ...] | None:
    """The storage key of ``t``, its local shard's for a DTensor, or None for a tensor without live storage (an FSDP
    parameter whose unsharded storage is freed between steps)."""
    to_local = getattr(t, "to_local", None)
    if to_local is not None:
        t = to_local()
    try:
        return _storage_key(t)
    except RuntimeError:
        return None


class SavedTensorBytes:
    """Context manager: bytes of the tensors autograd saves for backward inside it, each storage counted once.

    Storages of ``exclude`` (a module's parameters and buffers, which the stage holds anyway) are not counted.
    Inside ``torch.utils.checkpoint`` regions only the checkpoint's inputs are saved, and that is what is counted.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {key for key in map(_storage_key_or_none, exclude) if key is not None}
        self._seen: dict[tuple[Any, ...], tuple[int, Any]] = {}
        self._hooks: Any = None

    @property
    def bytes(self) -> int:
        return sum(n for n, _ in self._seen.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        part = t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]
        key = _storage_key_or_none(part)
        if key is None:
            # The result of a collective not waited for yet (tensor parallelism's all-reduce of a layer's output):
            # its storage is not there yet, its size is.
            self._seen[("pending", id(part))] = (part.numel() * part.element_size(), part)
        elif key not in self._exclude and key not in self._seen:
            # Holding the storage keeps its address from being reused by another tensor while we count.
            storage = part.untyped_storage()
            self._seen[key] = (storage.nbytes(), storage)
        # Not `t` itself: an op that saves its own output (ReLU, sigmoid, softmax) would then hold that output's
        # Python object in its grad_fn, which the output references: a cycle through C++ that Python's collector
        # cannot see, keeping the whole graph (activations, the batch, parameters) alive for good. A detached alias
        # holds the same storage and no grad_fn. (Saved tensors are values in backward; double backward through a
        # measured forward would lose them: the strategy never runs one.)
        return t.detach()

    def __enter__(self) -> SavedTensorBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        # Keep the byte counts, drop the storages: the caller may free the graph now.
        self._seen = {k: (n, None) for k, (n, _) in self._seen.items()}


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def saved_bytes(module: nn.Module, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> int:
    """Bytes ``module(*args, **kwargs)`` saves for backward (activations only: its own parameters are excluded)."""
    with torch.enable_grad(), SavedTensorBytes(exclude=_own_tensors(module)) as meter:
        module(*args, **(kwargs or {}))
    return meter.bytes


class SavedBytesRecorder:
    """Records the saved-for-backward bytes of the first forward of ``module`` run with gradients enabled.

    Meant for a stage module during the first training step: ``bytes`` is then the bytes the stage keeps per
    microbatch in flight. The hooks remove themselves after that forward.
    """

    def __init__(self, module: nn.Module) -> None:
        self.bytes: int | None = None
        self._module = module
        self._meter: SavedTensorBytes | None = None
        self._handles = [
            module.register_forward_pre_hook(self._start),
            module.register_forward_hook(self._stop),
        ]

    def _start(self, module: nn.Module, args: Any) -> None:
        if self.bytes is None and self._meter is None and torch.is_grad_enabled():
            self._meter = SavedTensorBytes(exclude=_own_tensors(module)).__enter__()

    def _stop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self.bytes, self._meter = self._meter.bytes, None
            self.remove()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


# ------------------------------------------------------------------------------------------------------ peak
def _rss_peak_reset() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak resident set size (Linux >= 4.0)
        return True
    except OSError:
        return False


def _proc_status_bytes(field: str) -> int | None:
    """A size from ``/proc/self/status`` (``VmHWM``: the peak resident set, ``VmRSS``: the current one) in bytes;
    ``None`` off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rss_peak() -> int | None:
    return _proc_status_bytes("VmHWM")


def _rss_now() -> int | None:
    return _proc_status_bytes("VmRSS")


def _cpu_storage(t: torch.Tensor) -> Any:
    """The storage of ``t`` on the CPU (a DTensor's: its shard's), or None (on another device, or without storage)."""
    part = t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]
    if part.device.type != "cpu" or torch_compat.is_fake(part):  # a fake tensor (dataflow's route plans) has no data
        return None
    try:
        storage = part.untyped_storage()
        storage.data_ptr()
    except RuntimeError:  # a tensor subclass without storage, or one that is not there yet (a pending collective)
        return None
    return storage


class _CPUTensorTracker:
    """Live and peak bytes of the CPU tensors created while it is active (see the module docstring)."""

    def __init__(self) -> None:
        TorchDispatchMode = torch_compat.dispatch_mode_class()

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                tracker.track(out, (args, kwargs))
                return out

        self.live = 0
        self.peak = 0
        self._ids: set[int] = set()
        self.mode = _Mode()

    def track(self, out: Any, inputs: Any) -> None:
        # Views and in-place results share an input's storage: not an allocation (the input may predate us).
        shared = {s.data_ptr() for s in map(_cpu_storage, tensors_in(inputs)) if s is not None}
        for t in tensors_in(out):
            storage = _cpu_storage(t)
            if storage is None or id(storage) in self._ids or storage.data_ptr() in shared:
                continue
            n = storage.nbytes()
            self._ids.add(id(storage))
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, id(storage), n)

    def _free(self, key: int, n: int) -> None:
        if key in self._ids:
            self._ids.discard(key)
            self.live -= n


class PeakMemory:
    """Context manager: the most bytes allocated at once on ``device`` inside it, above what was allocated before.

    ``bytes``: CUDA's ``max_memory_allocated`` (minus the allocation at entry), or on the CPU the peak of the live
    bytes of tensors created inside (tensors that existed before are not counted, as on CUDA). ``rss_bytes``
    (CPU, Linux): the process's peak resident set above the resident set at entry, or None where it cannot be read.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.bytes = 0
        self.rss_bytes: int | None = None
        self._base = 0
        self._tracker: _CPUTensorTracker | None = None
        self._rss_base: int | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        elif self.device.type == "cpu":
            self._rss_base = _rss_now() if _rss_peak_reset() else None
            self._tracker = _CPUTensorTracker()
            self._tracker.mode.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        elif self._tracker is not None:
            self._tracker.mode.__exit__(exc_type, exc, tb)
            self.bytes = self._tracker.peak
            peak = _rss_peak()
            if self._rss_base is not None and peak is not None:
                self.rss_bytes = max(peak - self._rss_base, 0)


class ProcessPeak:
    """The most memory this process held since :meth:`reset`: on CUDA the allocator's peak of allocated bytes; on the
    CPU the peak resident set size (``VmHWM``, reset through ``/proc/self/clear_refs``: Linux), which counts
    everything the process holds (Python, libraries, data), not only tensors. :meth:`read` is ``None`` where no peak
    can be read (or, on the CPU, reset)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._ok = False

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._ok = True
        else:
            self._ok = self.device.type == "cpu" and _rss_peak_reset()

    def read(self) -> int | None:
        if not self._ok:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        return _rss_peak()


def device_memory(device: torch.device, processes: int = 1) -> int | None:
    """The memory one of ``processes`` processes sharing ``device`` can use: a GPU's total memory, or on the CPU
    the machine's (``MemTotal``, Linux) divided among the processes; ``None`` where unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 // max(processes, 1)
    except OSError:
        pass
    return None


# ----------------------------------------------------------------------------------------------------- report
@dataclass(frozen=True)
class MemoryReport:
    """What one rank measured at startup; ``saved_per_microbatch`` maps stage index to bytes; ``tensor_parallel``:
    this rank's place among the ``(rank, size)`` processes sharing its stages, with the bytes of its parameter shards
    split over them (``None`` without tensor parallelism)."""

    rank: int
    stages: tuple[int, ...]
    state: StateBytes
    saved_per_microbatch: dict[int, int]
    construction_peak: int | None
    tensor_parallel: tuple[int, int, int] | None = None
    #: measured while the initial weights (``init_weights``) were loaded into the allocated stages
    load_peak: PeakMemory | None = None

    def lines(self) -> list[str]:
        """The log lines: one for the model state, one for the tensor-parallel share, one per stage's saved bytes,
        one each for construction and the loading of initial weights."""
        out = [self.state.report(self.rank, self.stages)]
        if self.tensor_parallel is not None:
            tp_rank, size, split = self.tensor_parallel
            out.append(
                f"rank {self.rank} is tensor-parallel rank {tp_rank} of {size}: {format_bytes(split)} of its parameters"
                f" are its 1/{size} share of layers split over the {size} ranks ({format_bytes(split * size)} in all);"
                f" the other {format_bytes(max(self.state.parameters - split, 0))} are held whole by each"
            )
        for stage, n in sorted(self.saved_per_microbatch.items()):
            out.append(f"rank {self.rank} stage {stage}: {format_bytes(n)} saved for backward per microbatch")
        if self.construction_peak is not None:
            out.append(f"rank {self.rank}: peak {format_bytes(self.construction_peak)} allocated during construction")
        if self.load_peak is not None:
            rss = self.load_peak.rss_bytes
            resident = f", resident set +{format_bytes(rss)}" if rss is not None else ""
            out.append(
                f"rank {self.rank}: peak {format_bytes(self.load_peak.bytes)} allocated{resident} while loading"
                " init_weights"
            )
        return out
