"""Counts the private names of grpclib, h2, hpack and hyperframe that engine_server's code uses.

A private name: one that starts with an underscore (or a dunder of grpclib's own, like `__gc_step__`, not
one of Python's) and that one of the four packages defines: a private module (`grpclib._typing`), a private
class or function imported, an attribute read or written on their objects, a method of theirs overridden
in a subclass of ours. Read statically (ast), so by name: `obj._x` counts when `_x` is one of theirs and
no class of ours makes an attribute of that name; one that both do is listed as "ambiguous" (review it).
grpclib's documented servicer and health-check protocols (`__mapping__`, `__check__`, ...) are public.

    python scripts/count_private_names.py [PACKAGE_DIR]   # default: server/engine_server

Prints each name with the files that use it, then the totals, and for each top-level folder how many names
it uses (tests/security/test_transport_internals.py: none outside api/transport/).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib
import importlib.util
import inspect
import sys
from collections import defaultdict
from pathlib import Path

THIRD_PARTY = ("grpclib", "h2", "hpack", "hyperframe")
PUBLIC_PROTOCOL = {"__mapping__", "__check__", "__status__", "__subscribe__", "__unsubscribe__"}
_PYTHON_DUNDERS = {name for value in vars(builtins).values() if isinstance(value, type)
                   for name in dir(value) if name.startswith("__")} | {
    "__slots__", "__all__", "__aenter__", "__aexit__", "__aiter__", "__anext__", "__await__",
    "__post_init__", "__set_name__", "__class_getitem__", "__file__", "__name__", "__version__",
    "__annotations__", "__future__", "__main__", "__wrapped__", "__path__"}


def is_private(name: str) -> bool:
    if name in PUBLIC_PROTOCOL or name == "_":
        return False
    if name.startswith("__") and name.endswith("__"):
        return name not in _PYTHON_DUNDERS
    return name.startswith("_")


def _names_defined(source: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            found.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            found.add(node.value)  # __slots__ entries, getattr names
    return found


def third_party_private_names() -> set[str]:
    names: set[str] = set()
    for package in THIRD_PARTY:
        spec = importlib.util.find_spec(package)
        assert spec is not None, package
        assert spec.origin is not None, package
        for path in Path(spec.origin).parent.rglob("*.py"):
            if path.stem.startswith("_") and path.stem != "__init__":
                names.add(path.stem)
            names |= _names_defined(path.read_text())
    return {name for name in names if is_private(name)}


def _third_party_imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> "module:attribute" (or "module:") of what the module imports from the four."""
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in THIRD_PARTY:
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{node.module}:{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in THIRD_PARTY:
                    imported[alias.asname or alias.name.split(".")[0]] = f"{alias.name.split('.')[0]}:"
    return imported


def _base_class(expr: ast.expr, imported: dict[str, str]) -> type | None:
    if isinstance(expr, ast.Subscript):
        return _base_class(expr.value, imported)
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.insert(0, expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name) or expr.id not in imported:
        return None
    module, _, attribute = imported[expr.id].partition(":")
    value: object = importlib.import_module(module)
    for part in ([attribute] if attribute else []) + parts:
        value = getattr(value, part)
    return value if isinstance(value, type) else None


def _class_attributes(cls: type) -> set[str]:
    """What a third-party class and its third-party bases define (methods, class and instance attributes)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] not in THIRD_PARTY:
            continue
        names |= set(vars(klass))
        with contextlib.suppress(OSError, TypeError, SyntaxError):
            names |= _names_defined(inspect.getsource(klass))
    return names


def count(package_dir: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """-> (name -> files, ambiguous name -> files)."""
    theirs = third_party_private_names()
    uses: dict[str, set[str]] = defaultdict(set)
    maybe: dict[str, set[str]] = defaultdict(set)
    ours: set[str] = set()
    for path in sorted(package_dir.rglob("*.py")):
        where = str(path.relative_to(package_dir))
        tree = ast.parse(path.read_text())
        imported = _third_party_imports(tree)
        skip: set[int] = set()  # attributes of our own objects (self.x in a class of ours)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [base for base in (_base_class(b, imported) for b in node.bases) if base is not None]
            inherited = set().union(*(_class_attributes(base) for base in bases)) if bases else set()
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item in node.body:
                    if is_private(item.name) and item.name in inherited:
                        uses[item.name].add(where)  # an override of a private method
                    elif is_private(item.name):
                        ours.add(item.name)
                elif isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) \
                        and item.value.id == "self":
                    skip.add(id(item))
                    if is_private(item.attr) and item.attr in inherited:
                        uses[item.attr].add(where)
                    elif is_private(item.attr) and isinstance(item.ctx, ast.Store):
                        ours.add(item.attr)
                elif isinstance(item, ast.Assign) and item in node.body:
                    for target in item.targets:
                        if isinstance(target, ast.Name) and target.id == "__slots__":
                            for entry in ast.walk(item.value):
                                if isinstance(entry, ast.Constant) and isinstance(entry.value, str):
                                    ours.add(entry.value)
                                    skip.add(id(entry))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Attribute) and id(node) not in skip:
                names = [node.attr]
            elif isinstance(node, ast.ImportFrom) and node.module \
                    and node.module.split(".")[0] in THIRD_PARTY:
                names = [*node.module.split("."), *(alias.name for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [part for alias in node.names if alias.name.split(".")[0] in THIRD_PARTY
                         for part in alias.name.split(".")]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.isidentifier() and id(node) not in skip:
                names = [node.value]  # getattr(obj, "_name")
            for name in names:
                if is_private(name) and name in theirs:
                    maybe[name].add(where)
    ambiguous: dict[str, set[str]] = {}
    for name, files in maybe.items():
        if name in ours and name not in uses:
            ambiguous[name] = files
        else:
            uses[name] |= files
    return dict(uses), ambiguous


def main() -> None:
    package_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "server/engine_server")
    uses, ambiguous = count(package_dir)
    for name in sorted(uses):
        print(f"{name:40} {', '.join(sorted(uses[name]))}")
    for name in sorted(ambiguous):
        print(f"{name:40} {', '.join(sorted(ambiguous[name]))}  (ambiguous: a name of ours too)")
    print(f"\n{len(uses)} private third-party names ({len(ambiguous)} more ambiguous)")
    per_folder: dict[str, set[str]] = defaultdict(set)
    for name, files in uses.items():
        for file in files:
            per_folder[str(Path(file).parent)].add(name)
    for folder in sorted(per_folder):
        print(f"  {folder}: {len(per_folder[folder])}")


if __name__ == "__main__":
    main()
