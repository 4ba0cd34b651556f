"""Guard rails for the shape of the code: layering, no import cycles, and package maps that are true.

The layers are ``protocols`` <- ``swarm`` <- ``peer``, ``coordinator`` <- ``lab`` (docs/architecture.md):
protocols imports nothing of ours, swarm imports neither application, the two applications do not import
each other (the coordinator never runs a volunteer, and a volunteer reaches the coordinator only over
gRPC), and no package imports the lab that rehearses them. Inside ``swarm``, no module imports the
rehearsal attacks (``swarm.byzantine``): they plug in through the library's hooks, from ``peer`` and ``lab``.

Inside ``swarm`` the parts are ordered too (``SWARM_LAYERS``): the foundation modules at its top level
(config, identity, records, DHT, inbound bounds...) import no part of it; ``data``, ``models`` and
``averaging`` import only the foundation and never each other; ``training`` builds on those three;
``pipeline`` on training too; the facade modules that compose a whole run (``session``, ``connection``,
``components``, ``keyspace``: every record kind's validator) on all of them; ``byzantine`` on everything.

Imports are read with ``ast``, so a module is never executed. Module-level and function-level imports
both count: a lazy import is still a dependency. Imports under ``if TYPE_CHECKING:`` are left out, as
they never run. Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``; those implicit
edges are left out, or every package that re-exports a submodule's names would be a cycle.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocols", "swarm", "peer", "coordinator", "lab")
# What each top-level package may import of ours, besides itself.
ALLOWED = {
    "protocols": set(),
    "swarm": {"protocols"},
    "peer": {"protocols", "swarm"},
    "coordinator": {"protocols", "swarm"},
    # The lab composes both applications into whole runs on one machine; nothing imports it.
    "lab": {"protocols", "swarm", "peer", "coordinator"},
}

# Rehearsal attacks: only the applications and the lab build them; the library calls them through its hooks.
REHEARSAL = "swarm.byzantine"
#: The built-in training loop: one caller of ``swarm.training.peer.TrainingPeer``, like a researcher's own.
BUILTIN_LOOP = "swarm.training.trainer"
# The order of ``swarm``'s parts (see the module docstring): a part imports only parts of lower rank, and
# itself. The parts of one rank are independent of each other.
SWARM_FACADE = ("swarm.session", "swarm.connection", "swarm.components", "swarm.keyspace")
SWARM_LAYERS = {
    "foundation": 0,
    "swarm.data": 1,
    "swarm.models": 1,
    "swarm.averaging": 1,
    "swarm.training": 2,
    "swarm.pipeline": 3,
    "facade": 4,
    "swarm.byzantine": 5,
}

Edge = tuple[str, str, int]  # importer, imported, line


def project_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the four packages under ``root``."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for branch in child.orelse:
                yield from _import_nodes(branch)
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        yield from _import_nodes(child)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module that importing ``name`` loads: the longest prefix that is one of ours."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def parse(text: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse``, tried again on CPython 3.11's "AST constructor recursion depth mismatch": its AST
    conversion keeps its depth in interpreter-wide state, so a parse in another thread at the same moment
    (a daemon thread left by an earlier test) fails this one spuriously (CPython gh-106905)."""
    for attempt in range(3):
        try:
            return ast.parse(text, filename=filename)
        except SystemError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """The project modules that ``module`` imports, with the line of each import."""
    edges = []
    is_package = path.name == "__init__.py"
    for node in _import_nodes(parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            # ``from a import b`` loads a.b when b is a submodule, else only a.
            names = [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                edges.append((module, target, node.lineno))
    return edges


def import_graph(root: Path) -> tuple[dict[str, list[Edge]], dict[str, Path]]:
    modules = project_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}, modules


def layering_violations(graph: dict[str, list[Edge]]) -> list[str]:
    problems = []
    for edges in graph.values():
        for importer, imported, line in edges:
            a, b = importer.split(".")[0], imported.split(".")[0]
            if a != b and b not in ALLOWED[a]:
                problems.append(f"{importer} (line {line}) imports {imported}: {a} may not import {b}")
    return problems


def swarm_part(module: str) -> str | None:
    """Which part of ``swarm`` (a key of ``SWARM_LAYERS``) ``module`` belongs to; None outside ``swarm``
    (and for ``swarm`` itself, whose map imports lazily by name)."""
    if not _within(module, "swarm") or module == "swarm":
        return None
    if module in SWARM_FACADE:
        return "facade"
    part = ".".join(module.split(".")[:2])
    return part if part in SWARM_LAYERS else "foundation"


def swarm_order_violations(graph: dict[str, list[Edge]]) -> list[str]:
    """Imports inside ``swarm`` against ``SWARM_LAYERS``, each naming both modules and their parts."""
    problems = []
    for edges in graph.values():
        for importer, imported, line in edges:
            a, b = swarm_part(importer), swarm_part(imported)
            if a is None or b is None or a == b or SWARM_LAYERS[b] < SWARM_LAYERS[a]:
                continue
            problems.append(f"{importer} (line {line}) imports {imported}: {a} may not import {b}")
    return problems


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def rehearsal_imports(graph: dict[str, list[Edge]]) -> list[str]:
    """Library modules (``swarm`` outside ``swarm.byzantine``) that import the rehearsal attacks."""
    return [
        f"{importer} (line {line}) imports {imported}: the library reaches attacks only through its hooks"
        for edges in graph.values()
        for importer, imported, line in edges
        if _within(imported, REHEARSAL) and _within(importer, "swarm") and not _within(importer, REHEARSAL)
    ]


def builtin_loop_imports(graph: dict[str, list[Edge]]) -> list[str]:
    """Library modules (``swarm`` outside the rehearsal package) that import the built-in loop: the library
    serves every loop through ``TrainingPeer``, so what it offers the built-in one it offers a researcher's."""
    return [
        f"{importer} (line {line}) imports {imported}: the library drives a TrainingPeer, not the built-in loop"
        for edges in graph.values()
        for importer, imported, line in edges
        if imported == BUILTIN_LOOP and _within(importer, "swarm") and not _within(importer, REHEARSAL)
    ]


def import_cycles(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """One cycle, in import order, for every strongly connected group of modules (Tarjan's algorithm)."""
    successors = {name: sorted({b for _, b, _ in edges}) for name, edges in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in successors[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(successors):
        if node not in index:
            visit(node)
    return [_cycle_in(group, successors) for group in groups]


def _cycle_in(group: set[str], successors: dict[str, list[str]]) -> list[str]:
    """The shortest path from the group's first module back to itself, staying inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in successors[node]:
                if nxt == start:
                    return [*paths[node], start]
                if nxt in group and nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")


def unlisted_modules(root: Path) -> list[str]:
    """Modules and subpackages that their package's ``__init__`` docstring does not name."""
    missing = []
    for package in PACKAGES:
        for init in sorted((root / package).rglob("__init__.py")):
            doc = ast.get_docstring(parse(init.read_text())) or ""
            for child in sorted(init.parent.iterdir()):
                if child.name == "__init__.py" or child.name.startswith(("_", ".")):
                    continue
                if child.suffix == ".py":
                    stem = child.stem
                    if "_pb2" in stem:  # generated from a .proto: the map names the .proto
                        names = [f"{stem.split('_pb2')[0]}.proto"]
                    else:
                        names = [f"``{stem}``", f"{stem}.py"]
                elif (child / "__init__.py").exists():
                    names = [f"``{child.name}``", f"{child.name}/"]
                else:
                    continue
                if not any(name in doc for name in names):
                    missing.append(f"{init.relative_to(root)} does not name {child.relative_to(root)}")
    return missing


def test_layers_point_one_way() -> None:
    graph, _ = import_graph(ROOT)
    assert sum(len(edges) for edges in graph.values()) > 100  # the parser sees the real imports
    assert layering_violations(graph) == []


def test_swarms_parts_point_one_way() -> None:
    graph, _ = import_graph(ROOT)
    assert swarm_order_violations(graph) == []


def test_the_library_never_imports_the_rehearsal_attacks() -> None:
    graph, _ = import_graph(ROOT)
    assert any(_within(imported, REHEARSAL) for edges in graph.values() for _, imported, _ in edges)
    assert rehearsal_imports(graph) == []


def test_the_library_never_imports_the_builtin_loop() -> None:
    graph, _ = import_graph(ROOT)
    assert any(imported == BUILTIN_LOOP for edges in graph.values() for _, imported, _ in edges)
    assert builtin_loop_imports(graph) == []


def test_no_import_cycle_among_the_projects_modules() -> None:
    graph, _ = import_graph(ROOT)
    cycles = [" -> ".join(cycle) for cycle in import_cycles(graph)]
    assert cycles == [], "import cycles: " + "; ".join(cycles)


def test_every_package_docstring_names_each_of_its_modules() -> None:
    assert unlisted_modules(ROOT) == []


# The checks above must be able to fail: run them on small trees that break each rule.


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text('"""Map."""\n')
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_cycle_is_reported_with_its_modules_in_order(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "swarm/a.py": "import swarm.b\n",
            "swarm/b.py": "def f():\n    from swarm.c import x\n",  # a lazy import still counts
            "swarm/c.py": "from swarm import a\n",
            "swarm/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import swarm.a\n",
            "swarm/__init__.py": '"""Map."""\nfrom swarm.d import y\n',
        },
    )
    graph, _ = import_graph(root)
    assert import_cycles(graph) == [["swarm.a", "swarm.b", "swarm.c", "swarm.a"]]


@pytest.mark.parametrize(
    "importer, statement, named",
    [
        ("protocols/x.py", "from swarm.y import z\n", "protocols.x (line 1) imports swarm.y"),
        ("swarm/x.py", "def f():\n    import peer.y\n", "swarm.x (line 2) imports peer.y"),
        ("swarm/x.py", "from coordinator import y\n", "swarm.x (line 1) imports coordinator.y"),
        ("peer/x.py", "import coordinator.y\n", "peer.x (line 1) imports coordinator.y"),
        ("coordinator/x.py", "from peer.y import z\n", "coordinator.x (line 1) imports peer.y"),
    ],
)
def test_an_import_against_the_layers_is_named(
    tmp_path: Path, importer: str, statement: str, named: str
) -> None:
    target = named.split(" imports ")[1].replace(".", "/") + ".py"
    root = _tree(tmp_path, {importer: statement, target: "z = 1\n"})
    graph, _ = import_graph(root)
    [problem] = layering_violations(graph)
    assert problem.startswith(named)


def test_an_import_against_swarms_order_is_named(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "swarm/config.py": "from swarm.averaging.groups import x\n",  # the foundation reaches up
            "swarm/averaging/groups.py": "from swarm.models import y\nfrom swarm.config import z\n",
            "swarm/models/__init__.py": '"""Map."""\n',
            "swarm/training/trainer.py": "from swarm.averaging.groups import x\n",  # downwards: allowed
            "swarm/pipeline/worker.py": "from swarm.training.trainer import t\n",  # downwards: allowed
            "swarm/session.py": "from swarm.pipeline.worker import w\n",  # the facade: allowed
        },
    )
    graph, _ = import_graph(root)
    assert sorted(swarm_order_violations(graph)) == [
        "swarm.averaging.groups (line 1) imports swarm.models: swarm.averaging may not import swarm.models",
        "swarm.config (line 1) imports swarm.averaging.groups: foundation may not import swarm.averaging",
    ]


def test_a_library_import_of_the_rehearsal_attacks_is_named(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "swarm/byzantine/__init__.py": '"""Map."""\n',
            "swarm/byzantine/attacks.py": "from swarm.training.hooks import TrainingHooks\n",
            "swarm/byzantine/colluders.py": "from swarm.byzantine.attacks import x\n",  # inside: allowed
            "swarm/training/__init__.py": '"""Map."""\n',
            "swarm/training/hooks.py": "TrainingHooks = object\n",
            "swarm/training/trainer.py": "def f():\n    from swarm.byzantine import attacks\n",  # lazy
            "swarm/averaging/factory.py": "import swarm.byzantine.colluders\n",
            "swarm/__init__.py": '"""Map."""\nimport swarm.byzantine\n',
            "peer/volunteer.py": "from swarm.byzantine.attacks import x\n",  # an application: allowed
        },
    )
    graph, _ = import_graph(root)
    assert sorted(rehearsal_imports(graph)) == [
        "swarm (line 2) imports swarm.byzantine: the library reaches attacks only through its hooks",
        "swarm.averaging.factory (line 1) imports swarm.byzantine.colluders: the library reaches attacks "
        "only through its hooks",
        "swarm.training.trainer (line 2) imports swarm.byzantine.attacks: the library reaches attacks only "
        "through its hooks",
    ]


def test_a_library_import_of_the_builtin_loop_is_named(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "swarm/training/__init__.py": '"""Map."""\n',
            "swarm/training/trainer.py": "from swarm.training.peer import TrainingPeer\n",
            "swarm/training/peer.py": "TrainingPeer = object\n",
            "swarm/training/collaboration.py": "from swarm.training.trainer import Trainer\n",
            "swarm/byzantine/__init__.py": '"""Map."""\n',
            "swarm/byzantine/colluders.py": "from swarm.training.trainer import Trainer\n",  # the rehearsal
            "peer/volunteer.py": "from swarm.training.trainer import Trainer\n",  # an application: allowed
        },
    )
    graph, _ = import_graph(root)
    assert builtin_loop_imports(graph) == [
        "swarm.training.collaboration (line 1) imports swarm.training.trainer: the library drives a "
        "TrainingPeer, not the built-in loop"
    ]


def test_a_module_missing_from_its_package_map_is_named(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "swarm/listed.py": "",
            "swarm/forgotten.py": "",
            "swarm/sub/__init__.py": '"""Map: ``inner``."""\n',
            "swarm/sub/inner.py": "",
            "protocols/wire_pb2.py": "",
        },
    )
    (root / "swarm" / "__init__.py").write_text('"""Map.\n\n- ``listed``: one\n- ``sub``: two\n"""\n')
    assert unlisted_modules(root) == [
        "protocols/__init__.py does not name protocols/wire_pb2.py",
        "swarm/__init__.py does not name swarm/forgotten.py",
    ]


def test_architecture_tables_name_functions_that_exist_in_their_files() -> None:
    """Every function in docs/architecture.md's tables is defined in one of the files its row names."""
    missing, rows = [], 0
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].isdigit():
            continue
        rows += 1
        files = re.findall(r"`([^`]+)`", cells[2])
        text = "".join((ROOT / f).read_text() for f in files)
        for name in re.findall(r"`([^`]+)`", cells[3]):
            for part in name.split("."):
                if not re.search(rf"(def|class) {re.escape(part)}\b", text):
                    missing.append(f"row {cells[0]}: {name} is not in {', '.join(files)}")
    assert rows >= 30 and missing == []
