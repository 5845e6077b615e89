"""How the user's unchanged ``training_step`` runs under a pipeline.

The pipelined network is never called as a whole. Its ``forward`` is replaced by a :class:`CallInterceptor`:

- on the rank holding the first stage, the user's step runs until it calls the network; the interceptor records the
  arguments (the pipeline's input) and stops the step;
- on the rank holding the last stage, the user's step runs once per microbatch as the schedule's loss function;
  the interceptor returns that microbatch's pipeline output, and the step computes its loss and logs from it.

``self.log`` calls made during those per-microbatch runs are recorded, merged over microbatches and replayed once,
on every rank, so every rank logs identical keys and rank 0's loggers and progress bar see the last stage's values.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from lightning_pipe.errors import PipelineUsageError


class _InputsCaptured(BaseException):
    """Ends the user's step at the network call (a BaseException, so ``except Exception`` cannot swallow it)."""


class CallInterceptor:
    """Stands in for the pipelined network's ``forward`` while the strategy runs a step."""

    def __init__(self, module: nn.Module, hook: str = "training_step") -> None:
        self._module = module
        self._mode = "off"
        self._output: Any = None
        self._used = False
        self.captured: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.hook = hook
        # An instance attribute shadows the class's forward; nn.Module.__call__ looks it up on the instance.
        module.forward = self  # type: ignore[method-assign]

    def remove(self) -> None:
        self._module.__dict__.pop("forward", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._mode == "capture":
            self.captured = (args, kwargs)
            raise _InputsCaptured
        if self._mode == "respond":
            if self._used:
                raise PipelineUsageError(
                    f"`{self.hook}` called the pipelined network more than once. A pipeline runs one forward pass"
                    " per microbatch: call the network once per step and derive everything from that output."
                )
            self._used = True
            return self._output
        if _called_from_model_summary():
            # Lightning's ModelSummary runs `example_input_array` through the model on rank 0 only; no rank holds the
            # whole network, so the summary goes without input/output sizes instead of failing.
            return None
        raise PipelineUsageError(
            f"The pipelined network ({type(self._module).__name__}) was called outside a training, validation, test"
            " or predict step. Under PipelineParallelStrategy each rank holds only its stages, so the network can"
            " only run through the strategy's steps."
        )

    def capture(self, step: Callable[[], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Run ``step`` until it calls the network and return the call's ``(args, kwargs)``."""
        self._mode, self.captured = "capture", None
        try:
            step()
        except _InputsCaptured:
            pass
        finally:
            self._mode = "off"
        if self.captured is None:
            raise PipelineUsageError(
                f"`{self.hook}` returned without calling the pipelined network, so the pipeline has no input."
                " Call the network (e.g. `self(x)` or `self.model(x)`) exactly once in each step."
            )
        return self.captured

    @contextmanager
    def responding(self, output: Any) -> Iterator[None]:
        """Within the block, the network's single call returns ``output``."""
        self._mode, self._output, self._used = "respond", output, False
        try:
            yield
        finally:
            self._mode, self._output = "off", None
        if not self._used:
            raise PipelineUsageError(
                f"`{self.hook}` did not call the pipelined network for this microbatch. Call the network"
                " (e.g. `self(x)`) exactly once in each step."
            )


def _called_from_model_summary(depth: int = 8) -> bool:
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == "_forward_example_input":
            return True
        frame = frame.f_back
    return False


@dataclass
class LoggedValue:
    """One ``self.log`` call recorded during a microbatch."""

    name: str
    value: Any
    kwargs: dict[str, Any] = field(default_factory=dict)


@contextmanager
def recording_logs(module: Any, sink: list[LoggedValue]) -> Iterator[None]:
    """Record ``module.log``/``module.log_dict`` calls into ``sink`` instead of logging them."""

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise PipelineUsageError(
                f"Pass `self.log({name!r}, ...)` options by keyword under PipelineParallelStrategy"
                " (e.g. `prog_bar=True`), so they can be replayed on every rank."
            )
        sink.append(LoggedValue(name, value, kwargs))

    def log_dict(dictionary: Any, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(dictionary).items():
            log(key, value, *args, **kwargs)

    module.log, module.log_dict = log, log_dict
    try:
        yield
    finally:
        del module.log, module.log_dict


def _is_metric(value: Any) -> bool:
    return any(cls.__module__.startswith("torchmetrics") for cls in type(value).__mro__) and hasattr(value, "compute")


def _to_float(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise PipelineUsageError(
                f"`self.log({name!r}, ...)` got a tensor of shape {tuple(value.shape)}; log scalars."
            )
        return float(value.detach().float().item())
    return float(value)


def merge_microbatch_logs(
    per_microbatch: list[list[LoggedValue]], weights: Sequence[float] | None = None
) -> list[LoggedValue]:
    """Merge the logs of one batch's microbatches into the value one full-batch call would have logged.

    Tensors and numbers are combined with the call's ``reduce_fx``: ``mean`` (the default) is weighted by ``weights``
    (the microbatch sizes; equal weights when ``None``), so a mean-reduced loss logged per microbatch becomes the batch
    mean even when the microbatches differ in size. A ``batch_size=`` passed to ``self.log`` is taken as that
    microbatch's weight and the merged call carries their sum. A torchmetrics object is kept as it is (its state
    already holds every microbatch); its float stand-in, for ranks that lack the object, is its last forward value.
    """
    order: list[str] = []
    grouped: dict[str, list[tuple[int, LoggedValue]]] = {}
    for index, logs in enumerate(per_microbatch):
        for entry in logs:
            if entry.name not in grouped:
                order.append(entry.name)
                grouped[entry.name] = []
            grouped[entry.name].append((index, entry))
    merged = []
    for name in order:
        entries = grouped[name]
        first = entries[0][1]
        if _is_metric(first.value):
            merged.append(LoggedValue(name, first.value, first.kwargs))
            continue
        values = [_to_float(name, e.value) for _, e in entries]
        kwargs = dict(first.kwargs)
        if kwargs.get("batch_size") is not None:
            entry_weights = [float(e.kwargs["batch_size"]) for _, e in entries]
            kwargs["batch_size"] = int(sum(entry_weights))
        else:
            entry_weights = [1.0 if weights is None else float(weights[i]) for i, _ in entries]
        merged.append(LoggedValue(name, _reduce(values, kwargs.get("reduce_fx", "mean"), entry_weights), kwargs))
    return merged


def _reduce(values: list[float], reduce_fx: Any, weights: Sequence[float]) -> float:
    name = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "mean")
    name = name.lower()
    if name in ("sum",):
        return math.fsum(values)
    if name in ("max", "amax"):
        return max(values)
    if name in ("min", "amin"):
        return min(values)
    return math.fsum(w * v for w, v in zip(weights, values)) / math.fsum(weights)
