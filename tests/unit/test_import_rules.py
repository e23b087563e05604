"""The server's layers import one way: api -> frontend -> core -> engine (docs/architecture.md).

Every import statement of every module counts, those inside functions and under TYPE_CHECKING too (a lazy
import is still a dependency), relative ones resolved against the module's package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import engine_server
import pytest

PACKAGE_DIR = Path(engine_server.__file__).parent

# layer -> the layers it must never import
FORBIDDEN = {
    "api": ("engine", "core"),
    "frontend": ("api",),
    "core": ("api", "frontend"),
    "engine": ("api", "frontend", "core"),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of each import in the module at `path`."""
    relative = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
    package = list(relative.parts[:-1])  # a module's package (an __init__'s: its own)
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            # `from engine_server import engine` imports a layer too
            found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "engine_server" and parts[1] in FORBIDDEN:
        return parts[1]
    return None


def _violations(layer: str) -> list[str]:
    bad = []
    for path in sorted((PACKAGE_DIR / layer).rglob("*.py")):
        for line, module in _imports(path):
            if _layer(module) in FORBIDDEN[layer]:
                bad.append(f"{path.relative_to(PACKAGE_DIR)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_never_imports_the_layers_above_it_or_skips_one(layer: str) -> None:
    assert (PACKAGE_DIR / layer).is_dir()
    assert _violations(layer) == []


def test_the_scanner_sees_every_kind_of_import() -> None:
    # NOTE: a scanner that saw nothing would pass every rule: check it on the real tree's known imports.
    servicer = {module for _, module in _imports(PACKAGE_DIR / "api" / "servicer.py")}
    assert "engine_server.frontend.types" in servicer
    requests = {module for _, module in _imports(PACKAGE_DIR / "api" / "vllm_compat" / "requests.py")}
    assert "engine_server.api.vllm_compat.engine_handle" in requests  # `from .engine_handle import ...`
    assert _layer("engine_server.engine.types") == "engine"
    assert _layer("engine_server.core") == "core"
    assert _layer("engine_server.frontend_extra") is None
