"""The test harness's shared launch (tests/launch.py ``Shared``): which modules' scenarios one launch runs."""

from __future__ import annotations

from pathlib import Path
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


def test_a_shared_launch_prepares_each_part_s_folder_and_makes_its_configs_before_launching(monkeypatch, tmp_path):
    import json

    from tests import launch

    launched = []

    def run_script(name, spec, **kwargs):
        parts = json.loads(spec)
        launched.append((name, parts, kwargs["timeout"]))
        for part in parts:  # each part's inputs are in its folder when the launch starts
            assert (Path(part["out"]) / "input.txt").read_text() == part["configs"][0]["name"]

    monkeypatch.setattr(launch, "run_script", run_script)
    shared = Shared(4)
    shared.part(
        "tests.a", "four", "parity.py", [{"name": "a"}], prepare=lambda out: (out / "input.txt").write_text("a")
    )
    made = lambda out: [{"name": "b", "in": out.name}]  # noqa: E731
    shared.part("tests.b", "four", "moe.py", made, timeout=900, prepare=lambda out: (out / "input.txt").write_text("b"))

    def mktemp(name: str) -> Path:
        (tmp_path / name).mkdir()
        return tmp_path / name

    factory = SimpleNamespace(mktemp=mktemp)
    session = SimpleNamespace(items=[_item("tests.a", "four"), _item("tests.b", "four")])
    request = SimpleNamespace(
        module=SimpleNamespace(__name__="tests.a"),
        fixturename="four",
        session=session,
        getfixturevalue=lambda name: factory,
    )
    assert shared.launch(request).out == tmp_path / "a-four"
    ((script, parts, timeout),) = launched
    assert script == "together.py" and timeout == 600 + 900
    assert [(p["script"], p["configs"]) for p in parts] == [
        ("parity.py", [{"name": "a"}]),
        ("moe.py", [{"name": "b", "in": "b-four"}]),
    ]
