"""The package's layering rules, checked on its source (see docs/architecture.md).

- Folders are layers with a rank: a module imports only its own folder or folders of a lower rank, never a folder of
  the same rank (the table ``RANKS``); nothing but the package's ``__init__`` imports the strategies
  (``strategy.py``, ``fabric.py``).
- Private names of torch, torchmetrics, transformers and Lightning are used only in ``lightning_pipe/compat/``: no
  private import, no ``obj._name``, no private name spelled as a string, and no ``self._name`` or ``def _name`` that
  belongs to a third-party base class.
- ``torch.distributed`` communication happens only in ``lightning_pipe/comm/collectives.py``, whose functions take a
  real process group (never ``None`` for "the world").
- One share sequence: only the step protocol sends a step's outcome.
- Imports form no cycle, in the package or in ``benchmarks/``: every import counts, at module level, inside a function
  or under ``if TYPE_CHECKING:`` (a deferred or type-only import still ties the two modules together; the cycle is
  dodged, not removed).
- Planning modules reach nothing that communicates; no module, of the package or of ``benchmarks/``, is over 600 lines.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pipe"
BENCHMARKS = PACKAGE.parent / "benchmarks"
THIRD_PARTY = ("torch", "torchmetrics", "lightning", "lightning_utilities", "pytorch_lightning", "transformers")
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
#: Each folder (or top-level module) and its rank: imports go to the same folder or to a lower rank only.
RANKS = {
    "errors": 0,
    "compat": 0,
    "structures": 0,
    "scope": 0,
    "schedules": 1,
    "settings": 2,
    "microbatch": 2,
    "measure": 2,
    "models": 3,
    "comm": 4,
    "split": 4,
    "reliability": 4,
    "parallel": 5,
    "checkpoint": 5,
    "step": 6,
    "callbacks": 7,
    "tune": 7,
    "session": 7,
    "strategy": 8,
    "fabric": 8,
    "": 9,  # the package's __init__
}
#: Modules that plan (pure functions of names, counts and settings): they must not reach anything that communicates.
PLANNING = (
    "lightning_pipe.schedules",
    "lightning_pipe.settings",
    "lightning_pipe.microbatch",
    "lightning_pipe.split.partition",
    "lightning_pipe.models",
)
COMMUNICATING = ("lightning_pipe.comm.collectives", "lightning_pipe.comm.transport", "lightning_pipe.step")
MAX_LINES = 600

# Underscore names the standard library documents as public API.
DOCUMENTED_STDLIB = {("os", "_exit")}
#: ... and the namedtuple API, documented public despite its underscores.
NAMEDTUPLE_API = {"_fields", "_asdict", "_replace", "_make", "_field_defaults"}
#: Our own private attribute names, set on third-party objects (the LightningModule) and read back by us.
OWN_PREFIX = "_lightning_pipe"


def _module_name(path: Path, root: Path = PACKAGE) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(PACKAGE)), ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_self(node: ast.expr) -> bool:
    if isinstance(node, ast.Name) and node.id in ("self", "cls"):
        return True
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_uses(tree: ast.Module) -> list[str]:
    """Private third-party imports, imports of another module's underscore names, ``obj._name`` accesses, and
    private names written as strings (``getattr(model, "_pp_plan")``)."""
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
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            private = re.fullmatch(r"_[A-Za-z]\w*", node.value) and node.value not in NAMEDTUPLE_API
            if private and not node.value.startswith(OWN_PREFIX):
                found.append(f"line {node.lineno}: {node.value!r}")
    return found


def _path_id(value: object) -> str:
    """A test id from the file or class name only: a tree's or class's repr holds its address, which differs between
    processes (pytest-xdist refuses a suite whose workers collect different ids)."""
    return value if isinstance(value, str) else ""


@pytest.mark.parametrize("path,tree", [s for s in _sources() if not s[0].startswith("compat")], ids=_path_id)
def test_private_names_only_in_compat(path, tree):
    assert private_uses(tree) == [], f"{path} uses private names; move them to lightning_pipe/compat/"


def test_the_rule_sees_private_uses():
    tree = ast.parse(
        "from torch.distributed.checkpoint._nested_dict import flatten_state_dict\n"
        "from torchmetrics import _x\nimport torch._C\nm._update_count = 1\nself._mine = 2\nsuper()._ok()\n"
        "getattr(model, '_pp_plan')\nnames = {'_TunerExitException'}\nmodule.__dict__['_lightning_pipe_split']\n"
    )
    assert len(private_uses(tree)) == 6


def _third_party_private_names(cls: type) -> set[str]:
    """Underscore names that a third-party base class of ``cls`` defines or assigns on ``self``."""
    names: set[str] = set()
    for base in cls.__mro__[1:]:
        if base.__module__.split(".")[0] not in THIRD_PARTY:
            continue
        names.update(n for n in vars(base) if _private(n))
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            continue
        names.update(re.findall(r"self\.(_[A-Za-z]\w*)\s*(?::[^=\n]*)?=", source))
    return names


def _own_private_names(tree: ast.ClassDef) -> dict[str, int]:
    """``self._name`` uses and ``def _name`` definitions in a class body, with a line each."""
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_self(node.value) and _private(node.attr):
            found.setdefault(node.attr, node.lineno)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
            found.setdefault(node.name, node.lineno)
    return found


def _classes_with_third_party_bases() -> list[tuple[str, type, ast.ClassDef]]:
    found = []
    for path, tree in _sources():
        if path.startswith("compat"):
            continue
        module_name = _module_name(PACKAGE / path)
        module = importlib.import_module(module_name)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            cls = getattr(module, node.name, None)
            if isinstance(cls, type) and any(b.__module__.split(".")[0] in THIRD_PARTY for b in cls.__mro__[1:]):
                found.append((f"{path}::{node.name}", cls, node))
    return found


@pytest.mark.parametrize("where,cls,node", _classes_with_third_party_bases(), ids=_path_id)
def test_no_private_names_of_base_classes(where, cls, node):
    theirs = _third_party_private_names(cls)
    uses = {name: line for name, line in _own_private_names(node).items() if name in theirs}
    assert uses == {}, f"{where} reaches private names of its third-party base classes; move them to compat/"


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


@pytest.mark.parametrize("path,tree", [s for s in _sources() if s[0] != "comm/collectives.py"], ids=_path_id)
def test_communication_only_in_collectives(path, tree):
    assert communication_calls(tree) == [], f"{path} calls torch.distributed directly; use lightning_pipe.comm"


def test_the_rule_sees_communication():
    tree = ast.parse("import torch.distributed as dist\ndist.all_reduce(t)\ntorch.distributed.barrier()\n")
    assert len(communication_calls(tree)) == 2


def test_collectives_take_a_real_group():
    """``None`` never stands for a process group: a function that communicates is given the group it uses."""
    tree = ast.parse((PACKAGE / "comm" / "collectives.py").read_text())
    defaults_to_none = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        args = node.args.args + node.args.kwonlyargs
        defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + list(node.args.defaults)
        defaults += list(node.args.kw_defaults)
        for arg, default in zip(args, defaults):
            if arg.arg == "group" and (default is not None):
                defaults_to_none.append(node.name)
    assert defaults_to_none == []


def test_one_share_sequence():
    users = [path for path, tree in _sources() if "OutcomeChannel(" in ast.unparse(tree)]
    assert users == ["step/protocol.py"], users


def _imports(tree: ast.Module, module_level: bool, package: str = "lightning_pipe") -> set[str]:
    """The modules of ``package`` that ``tree`` imports: at module level only, or anywhere (inside functions and
    under ``if TYPE_CHECKING:`` too) with ``module_level=False``."""
    deps: set[str] = set()
    nodes = tree.body if module_level else list(ast.walk(tree))

    def ours(name: str) -> bool:
        return name == package or name.startswith(package + ".")

    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and ours(node.module):
            # `from package import submodule` depends on the submodule (the package is already importing).
            deps.update(f"{node.module}.{a.name}" for a in node.names)
            deps.add(node.module)
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if ours(a.name))
    return deps


def _resolve(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each module's imports among the graph's modules (a package counts only when no submodule of it was named)."""
    resolved = {}
    for name, deps in graph.items():
        known = {d for d in deps if d in graph and d != name}
        resolved[name] = {d for d in known if not any(o.startswith(d + ".") for o in known)}
    return resolved


def import_graph(module_level: bool = True, root: Path = PACKAGE) -> dict[str, set[str]]:
    """Imports between the modules under ``root`` (lightning_pipe, or benchmarks): at module level (imports inside
    functions or TYPE_CHECKING excluded), or every import anywhere in the module with ``module_level=False``."""
    return _resolve(
        {
            _module_name(p, root): _imports(ast.parse(p.read_text()), module_level, root.name)
            for p in sorted(root.rglob("*.py"))
        }
    )


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: each set of modules that import one another, directly or through each other
    (a strongly connected component of more than one module), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_no_import_cycles():
    assert import_cycles(import_graph(module_level=False)) == []


def test_no_import_cycles_in_benchmarks():
    assert import_cycles(import_graph(module_level=False, root=BENCHMARKS)) == []


def _graph_of(sources: dict[str, str], package: str) -> dict[str, set[str]]:
    return _resolve({name: _imports(ast.parse(code), False, package) for name, code in sources.items()})


def test_the_cycle_rule_sees_every_import():
    """A cycle closed by a function-level import, or by one under TYPE_CHECKING, is reported; a one-way chain is not."""
    graph = _graph_of(
        {
            "lightning_pipe.a": "from lightning_pipe.b import f\n",
            "lightning_pipe.b": "def f():\n    from lightning_pipe import a\n",
            "lightning_pipe.c": "import lightning_pipe.a\nif TYPE_CHECKING:\n    from lightning_pipe.d import D\n",
            "lightning_pipe.d": "from lightning_pipe.c import C\n",
            "lightning_pipe.e": "from lightning_pipe.c import C\n",
        },
        "lightning_pipe",
    )
    assert import_cycles(graph) == [["lightning_pipe.a", "lightning_pipe.b"], ["lightning_pipe.c", "lightning_pipe.d"]]
    loop = {
        "benchmarks.run": "from benchmarks import phases, report\n",
        "benchmarks.report": "import benchmarks.stats\n",
    }
    loop["benchmarks.phases"] = "def main():\n    from benchmarks.run import launch\n"
    assert import_cycles(_graph_of(loop, "benchmarks")) == [["benchmarks.phases", "benchmarks.run"]]
    assert import_cycles({"x": {"y"}, "y": {"z"}, "z": set()}) == []


def folder(module: str) -> str:
    """The layer of a module: its folder under lightning_pipe, or its own name for a top-level module."""
    parts = module.split(".")[1:]
    return parts[0] if parts else ""


def test_every_folder_has_a_rank():
    assert {folder(m) for m in import_graph()} <= set(RANKS), set(map(folder, import_graph())) - set(RANKS)


def test_layers():
    """No import goes up, or sideways to another folder of the same rank (function-level imports included)."""
    wrong = []
    for module, deps in import_graph(module_level=False).items():
        mine = folder(module)
        for dep in deps:
            theirs = folder(dep)
            if theirs != mine and RANKS[theirs] >= RANKS[mine]:
                wrong.append(f"{module} -> {dep}")
    assert wrong == []
    for strategy in ("lightning_pipe.strategy", "lightning_pipe.fabric"):
        importers = [name for name, deps in import_graph(module_level=False).items() if strategy in deps]
        assert importers == ["lightning_pipe"], (strategy, importers)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


@pytest.mark.parametrize("planning", PLANNING)
def test_planning_needs_no_process_group(planning):
    reached = _reachable(import_graph(module_level=False), planning)
    assert not {m for m in reached if m.startswith(COMMUNICATING)}, f"{planning} reaches a communicating module"


def long_modules(root: Path) -> dict[str, int]:
    """The modules under ``root`` over :data:`MAX_LINES` lines, with their lengths."""
    return {
        str(p.relative_to(root)): n
        for p in sorted(root.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }


@pytest.mark.parametrize("root", [PACKAGE, BENCHMARKS], ids=lambda p: p.name)
def test_modules_stay_short(root):
    assert long_modules(root) == {}


def test_the_length_rule_sees_a_long_module(tmp_path):
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    assert long_modules(tmp_path) == {"long.py": MAX_LINES + 1}
