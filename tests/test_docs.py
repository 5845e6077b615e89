"""The documentation keeps up with the code: every error message and every strategy argument is documented."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from lightning_pipe import PipelineFabricStrategy, PipelineParallelStrategy

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_pipe"
DOCS = ROOT / "docs"


def _fragments(node: ast.expr) -> list[str]:
    """The literal text of a message expression (f-string placeholders left out)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant)]
    if isinstance(node, ast.BinOp):
        return _fragments(node.left) + _fragments(node.right)
    return []


def raised_messages() -> list[tuple[str, str]]:
    """``(location, longest literal fragment)`` of every exception raised with a message in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            # `raise Error(...)`, and `return Error(...)` from a function that builds an error raised elsewhere.
            made = node.exc if isinstance(node, ast.Raise) else getattr(node, "value", None)
            if not isinstance(node, (ast.Raise, ast.Return)) or not isinstance(made, ast.Call) or not made.args:
                continue
            if isinstance(node, ast.Return) and not ast.unparse(made.func).endswith(("Error", "Failure")):
                continue
            fragments = [" ".join(f.split()) for f in _fragments(made.args[0])]
            if fragments:
                found.append((f"{path.relative_to(PACKAGE)}:{node.lineno}", max(fragments, key=len).strip()))
    return found


def _normalised(text: str) -> str:
    return " ".join(text.split())


def test_messages_were_found() -> None:
    assert len(raised_messages()) > 40


@pytest.mark.parametrize(("where", "fragment"), raised_messages())
def test_every_error_message_is_in_troubleshooting(where: str, fragment: str) -> None:
    page = _normalised((DOCS / "troubleshooting.md").read_text())
    assert fragment in page, f"{where}: add this message, its cause and its fix to docs/troubleshooting.md"


def test_every_strategy_argument_is_documented() -> None:
    page = (DOCS / "strategy.md").read_text()
    headings = re.findall(r"^### `(\w+)`$", page, flags=re.MULTILINE)
    arguments = [n for n in inspect.signature(PipelineParallelStrategy.__init__).parameters if n != "self"]
    assert sorted(headings) == sorted(arguments)
    # Both strategies' constructor (one argument list) documents the arguments, where jsonargparse reads them.
    docstring = PipelineParallelStrategy.__init__.__doc__ or ""
    assert PipelineFabricStrategy.__init__ is PipelineParallelStrategy.__init__
    for name in arguments:
        assert re.search(rf"^\s+{name}: \S", docstring, flags=re.MULTILINE), f"`{name}` missing from `Arguments:`"


def test_mkdocs_nav_lists_every_page() -> None:
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = {next(iter(entry.values())) for entry in config["nav"]}
    present = {p.name for p in DOCS.glob("*.md")}
    assert present <= listed, f"pages missing from the mkdocs nav: {sorted(present - listed)}"
