"""Every third-party module the packages import is declared in pyproject.toml, and every module imports.

A dependency installed by hand on a developer's machine once hid an undeclared import (``safetensors``)
until a new user's first command crashed. These tests read the imports from the source itself, so a
module that happens to be installed here still fails the check when pyproject.toml does not name it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocols", "swarm", "peer", "coordinator")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> tuple[set[str], set[str]]:
    """(required distributions, distributions of optional extras other than dev), canonical names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {_canonical(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in requirements}

    extras = project.get("optional-dependencies", {})
    optional = set().union(*(names(reqs) for extra, reqs in extras.items() if extra != "dev"))
    return names(project["dependencies"]), optional


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _guarded_by_import_error(tree: ast.AST) -> set[int]:
    """Line numbers of imports inside ``try: ... except ImportError`` (optional features)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
            for h in node.handlers
        ):
            lines.update(
                n.lineno
                for stmt in node.body
                for n in ast.walk(stmt)
                if isinstance(n, ast.Import | ast.ImportFrom)
            )
    return lines


def _third_party_imports() -> dict[str, tuple[bool, str]]:
    """Top-level third-party module -> (optional, where it is first imported)."""
    found: dict[str, tuple[bool, str]] = {}
    stdlib = set(sys.stdlib_module_names)
    for path in _modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        optional_lines = _guarded_by_import_error(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in stdlib or top in PACKAGES or top == "__future__":
                    continue
                # torch.utils.tensorboard needs the tensorboard distribution, not just torch.
                module = "tensorboard" if name.startswith("torch.utils.tensorboard") else top
                optional = node.lineno in optional_lines
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                if module not in found or (found[module][0] and not optional):
                    found[module] = (optional, where)
    return found


def test_every_third_party_import_is_declared() -> None:
    required, optional = _declared()
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for module, (is_optional, where) in sorted(_third_party_imports().items()):
        candidates = {_canonical(d) for d in distributions.get(module, [module])}
        allowed = required | optional if is_optional else required
        if not candidates & allowed:
            kind = "an optional extra" if is_optional else "[project] dependencies"
            missing.append(f"{module} (imported at {where}) is not declared in {kind} of pyproject.toml")
    assert not missing, "\n".join(missing)


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    names = []
    for path in _modules():
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    script = (
        "import importlib, sys\n"
        "failed = []\n"
        f"for name in {names!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        failed.append(f'{name}: {e!r}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, f"modules that fail to import:\n{result.stdout}{result.stderr[-2000:]}"
