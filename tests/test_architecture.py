"""The package's layering rules, checked on its source (see docs/architecture.md).

- Private names of torch, torchmetrics and Lightning are used only in ``lightning_pipe/compat/``, and no module reaches
  into another object's underscore names.
- ``torch.distributed`` communication happens only in ``lightning_pipe/collectives.py``.
- One share sequence: only the step protocol sends a step's outcome.
- Module-level imports form no cycle; planning modules import no runtime module; nothing imports the strategy.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pipe"
THIRD_PARTY = ("torch", "torchmetrics", "lightning", "lightning_utilities", "pytorch_lightning")
COMMUNICATION = {
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
}


# Underscore names the standard library documents as public API.
DOCUMENTED_STDLIB = {("os", "_exit")}


def _sources() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(PACKAGE)), ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_self(node: ast.expr) -> bool:
    if isinstance(node, ast.Name) and node.id in ("self", "cls"):
        return True
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_uses(tree: ast.Module) -> list[str]:
    """Private third-party imports, imports of another module's underscore names, and ``obj._name`` accesses."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            names = [a.name for a in node.names]
            if parts[0] in THIRD_PARTY and (any(_private(p) for p in parts) or any(_private(n) for n in names)):
                found.append(f"line {node.lineno}: from {node.module} import {', '.join(names)}")
            elif parts[0] == "lightning_pipe" and any(_private(n) for n in names):
                found.append(f"line {node.lineno}: from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in THIRD_PARTY and any(_private(p) for p in alias.name.split(".")):
                    found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr) and not _is_self(node.value):
            if (ast.unparse(node.value), node.attr) in DOCUMENTED_STDLIB:
                continue
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


@pytest.mark.parametrize("path,tree", [s for s in _sources() if not s[0].startswith("compat")], ids=lambda v: str(v))
def test_private_names_only_in_compat(path, tree):
    assert private_uses(tree) == [], f"{path} uses private names; move them to lightning_pipe/compat/"


def test_the_rule_sees_private_uses():
    tree = ast.parse(
        "from torch.distributed.checkpoint._nested_dict import flatten_state_dict\n"
        "from torchmetrics import _x\nimport torch._C\nm._update_count = 1\nself._mine = 2\nsuper()._ok()\n"
    )
    assert len(private_uses(tree)) == 4


def communication_calls(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COMMUNICATION:
            base = ast.unparse(node.func.value)
            if base in ("dist", "torch.distributed", "c10d") or base.endswith("distributed_c10d"):
                found.append(f"line {node.lineno}: {base}.{node.func.attr}")
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch.distributed"):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name in COMMUNICATION]
    return found


@pytest.mark.parametrize("path,tree", [s for s in _sources() if s[0] != "collectives.py"], ids=lambda v: str(v))
def test_communication_only_in_collectives(path, tree):
    assert communication_calls(tree) == [], f"{path} calls torch.distributed directly; use lightning_pipe.collectives"


def test_the_rule_sees_communication():
    tree = ast.parse("import torch.distributed as dist\ndist.all_reduce(t)\ntorch.distributed.barrier()\n")
    assert len(communication_calls(tree)) == 2


def test_one_share_sequence():
    users = [path for path, tree in _sources() if "OutcomeChannel(" in ast.unparse(tree)]
    assert users == ["protocol.py"], users


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Module-level imports between lightning_pipe modules (imports inside functions or TYPE_CHECKING excluded)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        deps: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_pipe"):
                # `from package import submodule` depends on the submodule (the package is already importing).
                submodules = {f"{node.module}.{a.name}" for a in node.names}
                deps.update(submodules)
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("lightning_pipe"))
        graph[name] = deps
    resolved = {}
    for name, deps in graph.items():
        known = {d for d in deps if d in graph and d != name}
        # A package is a dependency only when no submodule of it was named.
        resolved[name] = {d for d in known if not any(o.startswith(d + ".") for o in known)}
    return resolved


def test_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in graph[node]:
            if state.get(dep) == 1:
                raise AssertionError(" -> ".join([*trail, node, dep]))
            if dep not in state:
                visit(dep, [*trail, node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_layers():
    graph = import_graph()
    runtime_layer = {
        "lightning_pipe.strategy",
        "lightning_pipe.protocol",
        "lightning_pipe.runtime",
        "lightning_pipe.executors",
        "lightning_pipe.collectives",
        "lightning_pipe.sharing",
    }
    for planning in ("lightning_pipe.config", "lightning_pipe.partition", "lightning_pipe.mesh"):
        assert not (_reachable(graph, planning) & runtime_layer), f"{planning} imports the runtime layer"
    importers = [name for name, deps in graph.items() if "lightning_pipe.strategy" in deps]
    assert importers == ["lightning_pipe"], importers
    assert not any(d.startswith("lightning_pipe.protocol") for d in _reachable(graph, "lightning_pipe.checkpoint"))
