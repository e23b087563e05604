"""engine-proto and engine-client build (sdist + wheel), pass `twine check`, install into a fresh
virtualenv and work there without the rest of the repository: an example script drives the real server.

About 15 s on an idle machine (two builds, a venv, installs from uv's cache).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from engine_client import EngineClient
from serverproc import RunningServer

ROOT = Path(__file__).parent.parent.parent
PROJECTS = {"engine_proto": ROOT / "gen" / "python", "engine_client": ROOT / "clients" / "python"}
UV = Path(sys.executable).parent / "uv"

EXAMPLE = textwrap.dedent("""
    import asyncio, json, sys
    import engine_client
    from engine_client import AsyncEngineClient, EngineClient

    async def stream(target: str) -> list[int]:
        async with AsyncEngineClient(target, timeout=60) as client:
            stream = client.generate("Hello", max_tokens=6, temperature=0.0)
            return [t async for c in stream for t in c.token_ids]

    with EngineClient(sys.argv[1], timeout=60) as client:
        result = client.complete("Hello", max_tokens=6, temperature=0.0)
        health = client.health().value
    print(json.dumps({"module": engine_client.__file__, "ids": list(result.token_ids), "health": health,
                      "streamed": asyncio.run(stream(sys.argv[1]))}))
""")


def run(*cmd: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_wheels_install_into_a_fresh_venv_and_run(engine_server: RunningServer, tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    # 1) build sdist + wheel of both distributions (no isolation: hatchling comes from the project venv)
    for project in PROJECTS.values():
        run(sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, project)
    artifacts = sorted(p.name for p in dist.iterdir())
    assert artifacts == ["engine_client-0.1.0-py3-none-any.whl", "engine_client-0.1.0.tar.gz",
                         "engine_proto-0.1.0-py3-none-any.whl", "engine_proto-0.1.0.tar.gz"]
    run(sys.executable, "-m", "twine", "check", "--strict", *sorted(dist.iterdir()))

    # 2) a fresh venv; our two packages only from the local wheels, third-party deps from uv's cache
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    wheels = [dist / "engine_proto-0.1.0-py3-none-any.whl", dist / "engine_client-0.1.0-py3-none-any.whl"]
    run(UV, "pip", "install", "--python", python, "--no-index", "--find-links", dist, "--no-deps", *wheels)
    deps = ["grpclib>=0.4.7,<0.5", "grpcio>=1.85.1", "protobuf>=7.35.1,<8"]
    try:
        run(UV, "pip", "install", "--python", python, "--offline", *deps)
    except AssertionError:
        run(UV, "pip", "install", "--python", python, *deps)  # cache miss: fetch from the index
    run(UV, "pip", "check", "--python", python)

    # 3) the example runs from an empty directory with a clean environment: nothing of the repo is importable
    work = tmp_path / "work"
    work.mkdir()
    (work / "example.py").write_text(EXAMPLE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = json.loads(run(python, "example.py", engine_server.target, cwd=work, env=env))
    assert out["module"].startswith(str(venv))
    assert out["health"] == "serving"
    with EngineClient(engine_server.target, timeout=60) as client:
        expected = list(client.complete("Hello", max_tokens=6, temperature=0.0).token_ids)
    assert out["ids"] == expected
    assert out["streamed"] == expected
    shutil.rmtree(venv)
