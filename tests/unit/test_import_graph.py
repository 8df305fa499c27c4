"""No import circles among pdv_ext's modules (issue #27 item 3).

The graph is built from the source with `ast`, not by importing: every `import` / `from ... import` of a
pdv_ext module counts, at module level or inside a function or class (a circle through a function-level
import is still a circle: it only moves the failure to whenever that function first runs).

How an import statement maps to edges (importer -> imported module):

* `import pdv_ext.a.b` -> `pdv_ext.a.b` (the deepest prefix that is a module of the package);
* `from P import x` (absolute or relative; `.` is the importer's package, a package's `__init__` being
  the package itself) -> `P.x` when `P.x` is a module (a submodule import), else -> `P` (a name that
  `P`'s module, or its package `__init__`, defines or re-exports);
* the parent packages Python initialises first (`pdv_ext.a` before `pdv_ext.a.b`) are edges too, from the
  importer to each parent package of the target *that is not a parent of the importer itself*: importing
  `pdv_ext.b.y` from `pdv_ext.a.x` runs `pdv_ext/b/__init__.py` first, and when that `__init__` imports
  `pdv_ext.a.x` back, the circle runs through it (`a.x -> b -> a.x`) though no statement names `pdv_ext.b`.
  A parent the importer shares is not an edge: it was initialised before the importer (or is the one
  initialising it), so a package `__init__` that re-exports its submodules is no circle by itself; it is
  one when such a submodule imports back a name *from the package* (`from . import name`,
  `from pdv_ext.a import name`).
* imports through `importlib.import_module("...")` strings (the package's lazy `__getattr__`, the CLI's
  sub-command table) are not seen: they name no module the source can resolve statically.
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pdv_ext

PACKAGE_DIR = Path(pdv_ext.__file__).parent

Edge = Tuple[str, str, str]  # importer, imported, "file:line"


def modules_of(package_dir: Path) -> Dict[str, Tuple[Path, bool]]:
    """module name -> (source file, is a package `__init__`)."""
    root = package_dir.parent
    mods = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def import_edges(package_dir: Path) -> List[Edge]:
    """Every import of one of the package's modules by another, mapped as the module docstring says."""
    mods = modules_of(package_dir)
    top = package_dir.name

    def deepest(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    edges: List[Edge] = []
    for importer, (path, is_pkg) in mods.items():
        package = importer if is_pkg else importer.rpartition(".")[0]
        where = path.relative_to(package_dir.parent)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [deepest(a.name) for a in node.names if a.name.split(".")[0] == top]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    if node.level - 1 >= len(parts):
                        continue  # beyond the top package: not ours
                    base = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base.split(".")[0] != top:
                    continue
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else deepest(base) for a in node.names]
            mine = set(parents(importer)) | {importer}
            for target in targets:
                if target and target != importer:
                    edges.append((importer, target, f"{where}:{node.lineno}"))
                # the target's parent packages that Python initialises first, unless this module's own
                for parent in parents(target):
                    if parent not in mine and parent in mods:
                        edges.append((importer, parent, f"{where}:{node.lineno}"))
    return edges


def parents(module: str) -> List[str]:
    """`pdv_ext.a.b.c` -> `pdv_ext`, `pdv_ext.a`, `pdv_ext.a.b` (the packages initialised before it)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_loops(edges: List[Edge]) -> List[List[str]]:
    """The circles: strongly connected components of more than one module (Tarjan), each sorted."""
    graph: Dict[str, Set[str]] = {}
    for a, b, _ in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    loops: List[List[str]] = []

    def visit(v: str) -> None:  # recursion depth <= number of modules (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                loops.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(loops)


def describe(loop: List[str], edges: List[Edge]) -> str:
    """One circle as its modules and the import statements that tie them."""
    members = set(loop)
    ties = sorted({f"    {where}: {a} imports {b}" for a, b, where in edges if a in members and b in members})
    return " <-> ".join(loop) + "\n" + "\n".join(ties)


def test_pdv_ext_has_no_import_loops():
    edges = import_edges(PACKAGE_DIR)
    assert len({a for a, _, _ in edges}) > 50  # the walk saw the package (not an empty or wrong directory)
    loops = import_loops(edges)
    assert not loops, (f"{len(loops)} import loop(s) among pdv_ext's modules; untie each at its cause (a function "
                       "in the wrong module, a registry loading its built-ins), not by moving an import into a "
                       "function:\n" + "\n".join(describe(loop, edges) for loop in loops))


def _package(tmp_path: Path, files: Dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "pdv_ext" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path / "pdv_ext"


def test_finds_loops_through_functions_relative_imports_and_package_names(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "config.py": "from .policy.config import PolicyConfig\n",
        "policy/__init__.py": "from .base import Policy\nfrom . import builtin\n",
        "policy/config.py": "def check():\n    from ..config import cross_check\n",  # loop 1: through a function
        "policy/base.py": "import pdv_ext.registry\n",
        "policy/builtin/__init__.py": "from . import one\n",
        "policy/builtin/one.py": "from ..base import Policy\n",  # re-exported by __init__: no loop
        "solvers/__init__.py": "REG = {}\nfrom . import dp\n",
        "solvers/dp.py": "from . import REG\n",  # loop 2: a name defined by the package's __init__
        "registry.py": "import os\nfrom os import path\n",
    })
    edges = import_edges(pkg)
    assert ("pdv_ext.policy.config", "pdv_ext.config", "pdv_ext/policy/config.py:2") in edges
    assert ("pdv_ext.policy.base", "pdv_ext.registry", "pdv_ext/policy/base.py:1") in edges
    assert ("pdv_ext.policy", "pdv_ext.policy.builtin", "pdv_ext/policy/__init__.py:2") in edges
    assert ("pdv_ext.solvers.dp", "pdv_ext.solvers", "pdv_ext/solvers/dp.py:1") in edges
    assert not [e for e in edges if e[0] == "pdv_ext.registry"]  # stdlib imports are not ours
    loops = import_loops(edges)
    assert loops == [["pdv_ext.config", "pdv_ext.policy.config"], ["pdv_ext.solvers", "pdv_ext.solvers.dp"]]
    text = describe(loops[0], edges)
    assert "pdv_ext/policy/config.py:2: pdv_ext.policy.config imports pdv_ext.config" in text


def test_finds_a_loop_through_a_package_init(tmp_path):
    """`a.x` imports `b.y`, which runs `b/__init__.py` first, and that `__init__` imports `a.x` back: a circle
    no statement spells out (`a.x` never names `b`). A package `__init__` importing its own submodules, and
    those importing each other, is none."""
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/x.py": "THING = 1\nfrom ..b import y\n",
        "b/__init__.py": "from ..a.x import THING\n",
        "b/y.py": "",
        "c/__init__.py": "from . import z\nfrom .w import W\n",
        "c/z.py": "from .w import W\nimport pdv_ext.c.w\n",
        "c/w.py": "W = 1\n",
    })
    edges = import_edges(pkg)
    assert ("pdv_ext.a.x", "pdv_ext.b.y", "pdv_ext/a/x.py:2") in edges
    assert ("pdv_ext.a.x", "pdv_ext.b", "pdv_ext/a/x.py:2") in edges  # b's __init__ runs first
    assert not [e for e in edges if e[1] == "pdv_ext.c" or e[1] == "pdv_ext"]  # parents the importer shares
    assert import_loops(edges) == [["pdv_ext.a.x", "pdv_ext.b"]]
    assert "pdv_ext/b/__init__.py:1: pdv_ext.b imports pdv_ext.a.x" in describe(import_loops(edges)[0], edges)


# ---------------------------------------------------------------------------------------------------
# Folders (issue #34): no circle between them, and the floors run one way
# ---------------------------------------------------------------------------------------------------
#: folders that know no engine, no benchmark and no playground (DESIGN.md: "placement and policy never
#: import integrations or bench"): they meet DeepSpeed and Horovod only through protocols
LOWER_FLOORS = ("aggregation", "comm", "kernels", "placement", "policy", "recovery", "config", "config_base", "registry",
                "log")
UPPER_FLOORS = ("integrations", "bench", "emulate", "cli", "examples")


def folder_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def folder_edges(edges: List[Edge]) -> List[Edge]:
    return [(folder_of(a), folder_of(b), where) for a, b, where in edges if folder_of(a) != folder_of(b)]


def climbs(edges: List[Edge]) -> List[str]:
    """Imports from a lower floor into an upper one, from the planner into the policies, and from the playground
    (emulate) into the benchmarks."""
    out = []
    for a, b, where in folder_edges(edges):
        if (a in LOWER_FLOORS and b in UPPER_FLOORS) or (a == "emulate" and b in ("bench", "cli")) \
                or (a == "placement" and b == "policy"):  # policies use the planner, never the other way
            out.append(f"{where}: {a} imports {b}")
    return sorted(set(out))  # one statement once (its target and the target's parent packages)


def test_folders_have_no_circles_and_no_climbs():
    edges = import_edges(PACKAGE_DIR)
    loops = import_loops(folder_edges(edges))
    assert not loops, "import circles between pdv_ext's folders:\n" + "\n".join(
        describe(loop, folder_edges(edges)) for loop in loops)
    bad = climbs(edges)
    assert not bad, ("imports that climb a floor (placement, policy, aggregation know DeepSpeed and Horovod only "
                     "through protocols; integrations/deepspeed holds what touches an engine):\n  " + "\n  ".join(bad))


def test_folder_rule_catches_a_climb_and_a_circle(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "placement/__init__.py": "",
        "placement/move.py": "def f():\n    from ..integrations.deepspeed import engine\n",
        "integrations/__init__.py": "",
        "integrations/deepspeed/__init__.py": "",
        "integrations/deepspeed/engine.py": "from ...placement import move\n",
        "emulate/__init__.py": "",
        "emulate/timer.py": "from ..bench.placement import reference_device\n",
        "bench/__init__.py": "",
        "bench/placement.py": "from ..emulate import timer\n",
    })
    edges = import_edges(pkg)
    assert climbs(edges) == ["pdv_ext/emulate/timer.py:1: emulate imports bench",
                             "pdv_ext/placement/move.py:2: placement imports integrations"]
    assert import_loops(folder_edges(edges)) == [["bench", "emulate"], ["integrations", "placement"]]
