"""Private torchmetrics names used by lightning-pipe, one function each (checked with torchmetrics 1.9).

Everything else uses the public API: ``metric_state``, ``update_count``, ``reset``, ``clone``, attribute assignment of
states. What remains has no public counterpart: the forward value Lightning logs on step, and the update counter and
compute cache that must follow a state copied in from another rank.
"""

from __future__ import annotations

from typing import Any


def is_metric(value: Any) -> bool:
    """Whether ``value`` is a ``torchmetrics.Metric`` (public class; tested by name, without importing torchmetrics
    when the user does not)."""
    return any(cls.__name__ == "Metric" and cls.__module__.startswith("torchmetrics") for cls in type(value).__mro__)


def is_mean_metric(value: Any) -> bool:
    """Whether ``value`` is a ``torchmetrics.MeanMetric`` (public class; tested by name like :func:`is_metric`)."""
    mro = type(value).__mro__
    return any(cls.__name__ == "MeanMetric" and cls.__module__.startswith("torchmetrics") for cls in mro)


def is_metric_container(value: Any) -> bool:
    """A torchmetrics object of any kind (a metric or a ``MetricCollection``): holds state, never a pipeline unit."""
    return any(cls.__module__.startswith("torchmetrics") for cls in type(value).__mro__)


def forward_value(metric: Any) -> Any:
    """The value of the metric's last ``forward`` (``metric._forward_cache``): what Lightning logs as the step value of
    a logged metric object. No public getter."""
    return metric._forward_cache


def set_forward_value(metric: Any, value: Any) -> None:
    """Set what Lightning will log as the metric's step value (``metric._forward_cache``).

    Used to make a step's value the full batch's when the step ran as several microbatches, and to mirror it on ranks
    that did not run the step. No public setter.
    """
    metric._forward_cache = value


def set_update_count(metric: Any, count: int) -> None:
    """Set ``metric.update_count`` (a read-only property over ``_update_count``) after copying states in from another
    rank, so ``compute`` neither warns that ``update`` was never called nor misjudges mean reductions."""
    metric._update_count = count


def invalidate(metric: Any) -> None:
    """Drop the cached result of ``compute`` (``metric._computed``) after states were assigned directly.

    Public ``reset()`` also drops it but clears the states too.
    """
    metric._computed = None


def never_sync(metric: Any) -> None:
    """Make ``compute`` on this metric purely local (``_to_sync`` and ``sync_on_compute``).

    Used on the private copies that compute a microbatched step's full-batch value: ``forward`` computes that value
    without synchronising, and so must they. ``sync_on_compute`` is a constructor argument only.
    """
    metric.sync_on_compute = False
    metric._to_sync = False
