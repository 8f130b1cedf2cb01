"""The source layout of veloce/: private names stay inside their package, imports of
veloce's own modules sit at the top of a module, and every file reads in one sitting.

The layers themselves (which package may import which) are import-linter's contract in
pyproject.toml (``lint-imports``, run by ``.ci/run``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "veloce"
FILES = sorted(ROOT.rglob("*.py"))
MAX_LINES = 700


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package(module: str, is_package: bool) -> str:
    """The package a module belongs to: itself for a package's ``__init__``, else its parent."""
    return module if is_package else module.rpartition(".")[0]


def _imports(tree: ast.AST, path: Path) -> list[tuple[ast.AST, str, list[str]]]:
    """Every import of veloce's own modules in ``tree``: (node, imported module, names)."""
    module = _module(path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "veloce" or a.name.startswith("veloce."):
                    out.append((node, a.name, []))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if path.name != "__init__.py":
                    base.pop()
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "veloce" or target.startswith("veloce."):
                out.append((node, target, [a.name for a in node.names]))
    return out


def _private_parts(target: str, names: list[str]) -> list[str]:
    """The underscore-private modules of ``target`` and the private ``names`` imported
    from it (the dunder names aside)."""
    private = [p for p in target.split(".") if p.startswith("_") and not p.startswith("__")]
    return private + [n for n in names if n.startswith("_") and not n.startswith("__")]


def _owner(target: str) -> str:
    """The package that owns the first private part of ``target`` (or ``target`` itself)."""
    parts = target.split(".")
    for i, p in enumerate(parts):
        if p.startswith("_") and not p.startswith("__"):
            return ".".join(parts[:i])
    return target


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_private_name_across_packages(path: Path) -> None:
    """``from veloce.x import _y`` and ``from veloce.x._y import z`` only inside veloce.x."""
    tree = ast.parse(path.read_text(), str(path))
    here = _package(_module(path), path.name == "__init__.py")
    bad = []
    for node, target, names in _imports(tree, path):
        private = _private_parts(target, names)
        if not private:
            continue
        owner = _owner(target)
        # A private module is owned by the package holding it; a private name by the module's package.
        if any(n.startswith("_") for n in names) and owner == target:
            owner = _package(target, (ROOT.parent / target.replace(".", "/") / "__init__.py").exists())
        if here != owner and not here.startswith(owner + "."):
            bad.append(f"line {node.lineno}: {target} {private}")
    assert not bad, f"{path.name} imports private names of another package: {bad}"


def _catches_import_error(node: ast.AST) -> bool:
    """A ``try`` with an ``except ImportError`` (or ModuleNotFoundError): the guard of an
    optional dependency."""
    if not isinstance(node, ast.Try):
        return False
    names = set()
    for h in node.handlers:
        for t in (h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]):
            if isinstance(t, ast.Name):
                names.add(t.id)
    return bool(names & {"ImportError", "ModuleNotFoundError"})


def _function_imports(tree: ast.AST) -> list[ast.AST]:
    """Imports inside a function (or a method) body, except those under a ``try`` that
    catches ImportError (a module that needs an optional dependency, imported where used)."""
    found = []

    def visit(node: ast.AST, in_function: bool, guarded: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function and not guarded:
                found.append(child)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
                  guarded or (_catches_import_error(child) and in_function))

    visit(tree, False, False)
    return found


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_function_level_import_of_veloce(path: Path) -> None:
    """veloce's own modules are imported at the top of a module (optional dependencies such
    as ray or tensorboard may be imported where they are used)."""
    tree = ast.parse(path.read_text(), str(path))
    inner = {id(n) for n in _function_imports(tree)}
    bad = [f"line {node.lineno}: {target}" for node, target, _ in _imports(tree, path) if id(node) in inner]
    assert not bad, f"{path.name} imports veloce's modules inside functions: {bad}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_file_size(path: Path) -> None:
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT.parent)} has {n} lines (at most {MAX_LINES})"


def _veloce_op_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """Every ``torch.ops.veloce.NAME`` in ``tree``: (line, NAME)."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "veloce"
                and isinstance(node.value.value, ast.Attribute) and node.value.value.attr == "ops"
                and isinstance(node.value.value.value, ast.Name) and node.value.value.value.id == "torch"):
            found.append((node.lineno, node.attr))
    return found


def _defined_ops(tree: ast.AST) -> set[str]:
    """The ``veloce::NAME`` ops a module defines itself (``torch.library.custom_op("veloce::NAME", ...)``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            value = node.args[0].value
            if isinstance(value, str) and value.startswith("veloce::"):
                names.add(value.split("::", 1)[1])
    return names


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_only_the_op_layer_calls_torch_ops_veloce(path: Path) -> None:
    """``torch.ops.veloce.*`` is called through veloce.ops' typed wrappers, except by a module
    that defines the op itself in Python (the compiled lookup's ops)."""
    if path.relative_to(ROOT).parts[0] == "ops":
        return
    tree = ast.parse(path.read_text(), str(path))
    own = _defined_ops(tree)
    bad = [f"line {line}: torch.ops.veloce.{name}" for line, name in _veloce_op_calls(tree) if name not in own]
    assert not bad, f"{path.name} calls veloce's ops around veloce.ops: {bad}"


def test_test_files_have_distinct_names() -> None:
    # The test folders are not packages (pytest's rootdir-relative imports): two test files
    # of one name in different folders cannot be collected in one run.
    tests = Path(__file__).resolve().parent
    seen: dict[str, Path] = {}
    for path in sorted(tests.rglob("test_*.py")):
        other = seen.setdefault(path.name, path)
        assert other == path, f"{other.relative_to(tests)} and {path.relative_to(tests)} share a name: rename one"
