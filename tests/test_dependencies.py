"""Declared dependencies == imported ones: every third-party module proxy/ imports comes from a
distribution pyproject.toml declares (at runtime, or in the optional extra whose feature imports
it), and every declared runtime distribution is imported by proxy/ (or named where it is used)."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, which pytest itself requires there
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("kubernetes", "tracing")  # optional features of proxy/; dev and bench serve tests and loadtest/
# distributions proxy/ uses by name rather than by import: (file, the text that uses it)
BY_NAME = {"uvloop": ("proxy/cli.py", '"loop": "uvloop"')}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imports(root: Path) -> dict[str, set[str]]:
    """Absolute third-party module paths imported anywhere in `root` -> the files importing them
    (`from a import b` counts as `a.b`: b may be a submodule of a namespace package)."""
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("proxy", "__future__"):
                    found.setdefault(name, set()).add(str(path.relative_to(root.parent)))
    return found


def declared(pyproject: dict) -> dict[str, str]:
    """Normalised distribution name -> where it is declared ("runtime" or the extra's name)."""
    out: dict[str, str] = {}
    project = pyproject["project"]
    for where, requirements in [("runtime", project["dependencies"]),
                                *((extra, project["optional-dependencies"][extra]) for extra in EXTRAS)]:
        for requirement in requirements:
            out.setdefault(normalise(re.match(r"[A-Za-z0-9._-]+", requirement).group()), where)
    return out


def module_owners(distributions: set[str]) -> dict[str, str]:
    """Dotted module path -> the (normalised) distribution installing it, for `distributions`."""
    owners: dict[str, str] = {}
    for dist in distributions:
        try:
            files = importlib.metadata.distribution(dist).files or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for file in files:
            parts = file.parts
            if not parts or ".dist-info" in parts[0] or parts[0] == "..":
                continue
            stem = parts[-1].split(".")[0]
            if parts[-1].endswith((".py", ".so", ".pyd")):
                module = parts[:-1] if stem == "__init__" else (*parts[:-1], stem)
                if module:
                    owners.setdefault(".".join(module), dist)
    return owners


def problems(found: dict[str, set[str]], wanted: dict[str, str], owners: dict[str, str],
             by_name: dict[str, tuple[str, str]], read=lambda path: (ROOT / path).read_text()) -> list[str]:
    """What breaks "declared == imported", as sentences (empty: all good)."""
    out = []
    used: set[str] = set()
    for name, files in sorted(found.items()):
        parts = name.split(".")
        owner = next((owners[".".join(parts[:n])] for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in owners), None)
        if owner is None:
            out.append(f"{name} (imported by {', '.join(sorted(files))}) comes from no declared distribution")
        else:
            used.add(owner)
    for dist, (path, text) in by_name.items():
        if text in read(path):
            used.add(dist)
    for dist, where in sorted(wanted.items()):
        if dist not in used:
            out.append(f"{dist} is declared ({where}) but proxy/ does not import it")
    return out


def test_declared_dependencies_are_exactly_the_imported_ones() -> None:
    wanted = declared(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    found = imports(ROOT / "proxy")
    assert problems(found, wanted, module_owners(set(wanted)), BY_NAME) == []
    assert "aiohttp" not in wanted  # the control plane is on httpx; only kubernetes_asyncio brings it in


def test_the_check_fails_on_an_undeclared_import_and_on_an_unused_dependency() -> None:
    wanted = declared(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    found = imports(ROOT / "proxy")
    owners = module_owners(set(wanted))
    fewer = {d: w for d, w in wanted.items() if d != "orjson"}
    missing = problems(found, fewer, module_owners(set(fewer)), BY_NAME)
    assert missing and all(p.startswith("orjson") and p.endswith("comes from no declared distribution") for p in missing)
    assert problems(found, {**wanted, "requests": "runtime"}, owners, BY_NAME) == [
        "requests is declared (runtime) but proxy/ does not import it"
    ]
    assert problems(found, wanted, owners, BY_NAME, read=lambda path: "") == [
        "uvloop is declared (runtime) but proxy/ does not import it"
    ]
