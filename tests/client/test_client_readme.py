"""Every ```python block of clients/python/README.md runs against a real server (doc examples must run).

Blocks fenced as ```python are executed in order, each in a fresh namespace, with the README's placeholder
target replaced by the test server's; blocks fenced ```python no-run (TLS to a made-up host) are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from serverproc import RunningServer

README = Path(__file__).parent.parent.parent / "clients" / "python" / "README.md"
PLACEHOLDER = "127.0.0.1:50051"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def readme_blocks() -> list[str]:
    return BLOCK.findall(README.read_text())


def test_readme_has_runnable_examples() -> None:
    blocks = readme_blocks()
    assert len(blocks) >= 5
    assert all(PLACEHOLDER in block for block in blocks)


@pytest.mark.parametrize("index", range(len(readme_blocks())))
def test_readme_example_runs(index: int, engine_server: RunningServer,
                             capsys: pytest.CaptureFixture[str]) -> None:
    source = readme_blocks()[index].replace(PLACEHOLDER, engine_server.target)
    exec(compile(source, f"{README.name}[python block {index}]", "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out  # every example prints something
