"""The test harness's shared launch (tests/launch.py ``Shared``): which modules' scenarios one launch runs."""

from __future__ import annotations

from types import SimpleNamespace

from tests.launch import Shared


def _item(module: str, *fixtures: str) -> SimpleNamespace:
    return SimpleNamespace(module=SimpleNamespace(__name__=module), fixturenames=list(fixtures))


def test_a_shared_launch_runs_the_parts_that_selected_tests_read_in_import_order():
    shared = Shared(4)
    for module, script in (("tests.a", "parity.py"), ("tests.b", "decoder.py"), ("tests.c", "moe.py")):
        shared.part(module, "four_procs", script, [{"name": module}])
    # tests.b's selected test reads another fixture; tests.d declared no part; a non-Python item has no module
    items = [_item("tests.c", "four_procs"), _item("tests.b", "tmp_path"), _item("tests.d", "four_procs"), object()]
    assert shared.needed(("tests.a", "four_procs"), items) == [("tests.a", "four_procs"), ("tests.c", "four_procs")]
    # a part already launched in this session is not launched again; the requesting one always is
    shared.launches[("tests.a", "four_procs")] = object()
    assert shared.needed(("tests.b", "four_procs"), items) == [("tests.b", "four_procs"), ("tests.c", "four_procs")]
