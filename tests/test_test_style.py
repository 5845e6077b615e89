"""The tests' own habits: a failing scenario of a shared launch fails its own tests and no other's; an error-message
test matches the names and values the message must carry and the fix's key words, not its wording."""

from __future__ import annotations

import ast
import re
import subprocess

import pytest
import torch

from tests.launch import ROOT, Launch
from tests.scripts.outcomes import run_each

#: Five plain words in a row: runs of letters joined by single spaces. A run right after a letter, a digit, ``_`` or a
#: backslash is no word (it belongs to a name, a number or a regex escape such as ``\w`` or ``\b``), nor is one right
#: before a letter, digit or ``_``; anything else (``.*``, a quote, a backtick, a bracket) ends the run.
PROSE = re.compile(r"(?<![\\\w])[A-Za-z]+(?: [A-Za-z]+){4,}(?!\w)")


def match_patterns(source: str) -> list[tuple[int, list[str]]]:
    """The literal ``match=`` patterns of a source file: (line, its literal parts; an f-string's text between its
    placeholders). A pattern held in a variable is not literal and not read."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword) and node.arg == "match":
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.append((value.lineno, [value.value]))
            elif isinstance(value, ast.JoinedStr):
                parts = [part.value for part in value.values if isinstance(part, ast.Constant)]
                found.append((value.lineno, [part for part in parts if isinstance(part, str)]))
    return found


def prose(parts: list[str]) -> str | None:
    """The first run of five or more plain words in a pattern's literal parts, if any."""
    return next((found.group(0) for part in parts if (found := PROSE.search(part))), None)


def test_message_tests_match_names_values_and_the_fix_not_sentences():
    found = [
        f"{path.relative_to(ROOT)}:{line}: {run!r}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for line, parts in match_patterns(path.read_text())
        if (run := prose(parts))
    ]
    assert not found, (
        "these `match=` patterns pin five or more words of a message's prose; match the exception's names, values and"
        " the fix's key words instead (e.g. r\"`schedule='Foo'`.*GPipe\"):\n" + "\n".join(found)
    )


def test_the_checker_catches_a_sentence_and_lets_names_values_and_key_words_pass():
    source = (
        'pytest.raises(E, match="must name distinct blocks in model order")\n'
        'pytest.warns(W, match=f"{name} is not a block of the model")\n'
        "pytest.raises(E, match=r\"`split_points=\\['layers\\.0'\\]`.*distinct blocks.*model order\")\n"
        'pytest.raises(E, match=rf"`schedule={name!r}`.*one stage per rank.*`stages_per_rank=1`")\n'
        'pytest.raises(E, match=r"\\bwas called with keyword arguments")\n'
        "pytest.raises(E, match=pattern)\n"
    )
    runs = {line: prose(parts) for line, parts in match_patterns(source)}
    assert runs == {
        1: "must name distinct blocks in model order",
        2: "is not a block of the model",  # an f-string's text is read between its placeholders
        3: None,
        4: None,  # "one stage per rank": four words
        5: None,  # a letter run after a backslash is an escape (\b), so four words remain
    }


def _scenario(out, cfg):
    if cfg["name"] == "broken":
        raise ValueError(f"no such layer: {cfg['layer']!r}")
    torch.save({"name": cfg["name"]}, out / f"{cfg['name']}.rank0.pt")


def test_a_failing_scenario_fails_its_own_test_and_the_launch_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    configs = [{"name": "first"}, {"name": "broken", "layer": "mlp.fc9"}, {"name": "after"}]
    run_each(tmp_path, configs, _scenario)
    launch = Launch(tmp_path, 1, subprocess.CompletedProcess([], 0, "", ""))
    assert [r["name"] for r in launch.ranks("first") + launch.ranks("after")] == ["first", "after"]
    with pytest.raises(pytest.fail.Exception) as failed:
        launch.ranks("broken")
    assert "scenario broken failed" in str(failed.value) and "ValueError: no such layer: 'mlp.fc9'" in str(failed.value)


def test_a_scenario_the_launch_never_reached_fails_with_the_launch_output(tmp_path):
    launch = Launch(tmp_path, 2, subprocess.CompletedProcess([], -9, "step 3 of 6", "killed after 600 s"))
    with pytest.raises(pytest.fail.Exception) as failed:
        launch.ranks("late")
    message = str(failed.value)
    assert "late.rank0.pt" in message and "exited -9" in message and "killed after 600 s" in message
