"""The structure of the package: every module imports, no two modules import each other through
any chain (module-level or deferred imports alike), and only the family registry and a family's own
modules name drafter families."""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest

import dcoco
from dcoco.families import FAMILIES

SRC = Path(dcoco.__file__).resolve().parent


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py")) if "checkpoints" not in p.parts}


def imported_modules(name: str, path: Path) -> set[str]:
    """dcoco modules `name` imports anywhere in its body: `from .x import y` counts as module x.y when
    that is a module, else as x (a package's __init__ or a plain module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                full = f"{mod}.{alias.name}"
                out.add(full if full in MODULES else mod)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in MODULES and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return []

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_every_public_name_resolves():
    """`from dcoco import X` works for every name the package lists (they are imported lazily)."""
    import dcoco

    for name in dcoco.__all__:
        assert getattr(dcoco, name) is not None, name


def test_no_import_cycle():
    graph = {n: imported_modules(n, p) for n, p in MODULES.items()}
    assert find_cycle(graph) == []


def test_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def string_literals(path: Path) -> list[tuple[int, str]]:
    """(line, value) of every string literal that is not a docstring or part of an f-string's text."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.STRING and not tok.string.startswith(('"""', "'''")):
            try:
                out.append((tok.start[0], ast.literal_eval(tok.string)))
            except ValueError:
                pass
    return out


#: lines where "dcoco" is the project's name, not the family's
PROJECT_NAME = re.compile(r'PROG = "dcoco"|title="dcoco"|"owned_by": "dcoco"|Path\(base\) / "dcoco"')


def test_only_the_registry_names_families():
    own = {SRC / "families"} | {SRC / "drafters" / f"{n}.py" for n in FAMILIES}
    offenders = []
    for path in MODULES.values():
        if any(path == o or o in path.parents for o in own):
            continue
        lines = path.read_text().splitlines()
        for line, value in string_literals(path):
            if value in FAMILIES and not PROJECT_NAME.search(lines[line - 1]):
                offenders.append(f"{path.relative_to(SRC)}:{line}: {value!r}")
    assert offenders == []
