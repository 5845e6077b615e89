"""What a Trainer entry installs on the user's objects is undone when it ends (lightning_pipe.scope)."""

from __future__ import annotations

import warnings

import pytest
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from lightning_pipe.scope import SYNC_DIST_ADVICE, ignoring, replaced


class _Plugin:
    def clip(self) -> str:
        return "class"


def test_replaced_restores_the_class_method_or_the_instance_attribute():
    plugin = _Plugin()
    with replaced(plugin, "clip", lambda: "pipeline"):
        assert plugin.clip() == "pipeline"
    assert plugin.clip() == "class" and "clip" not in vars(plugin)
    plugin.clip = lambda: "user"  # the user's own override comes back too
    with replaced(plugin, "clip", lambda: "pipeline"):
        assert plugin.clip() == "pipeline"
    assert plugin.clip() == "user"


def test_ignoring_removes_only_its_own_filter():
    # Lightning's exact advice (lightning/pytorch/trainer/connectors/logger_connector/result.py)
    advice = (
        "It is recommended to use `self.log('val_loss', ..., sync_dist=True)` when logging on epoch level in"
        " distributed setting to accumulate the metric across devices."
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ignoring(SYNC_DIST_ADVICE, PossibleUserWarning):
            warnings.warn(advice, PossibleUserWarning, stacklevel=1)
            warnings.filterwarnings("ignore", message="kept")  # added meanwhile by someone else
            warnings.warn("another warning", PossibleUserWarning, stacklevel=1)
        warnings.warn(advice, PossibleUserWarning, stacklevel=1)
        warnings.warn("kept", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["another warning", advice]


def test_the_sync_dist_filter_is_narrow():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ignoring(SYNC_DIST_ADVICE, PossibleUserWarning):
            warnings.warn("It is recommended to use `self.log('x', ..., sync_dist=True)`", UserWarning, stacklevel=1)
    assert len(caught) == 1  # another category is not touched


@pytest.mark.parametrize("category", [DeprecationWarning, FutureWarning])
def test_ignoring_any_message_of_a_category(category):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ignoring("", category):
            warnings.warn("x is deprecated", category, stacklevel=1)
        warnings.warn("x is deprecated", category, stacklevel=1)
    assert len(caught) == 1
