#!/usr/bin/env bash
# Regenerates gen/ from proto/: installs the pinned plugins if missing, runs `buf generate`, then fixes up the
# Python package layout. CI runs this and fails on any difference (`git diff --exit-code gen/`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/bootstrap.sh all
# betterproto2 formats its output with the ruff on PATH: use the pinned one.
export PATH="$root/.venv/bin:$PATH"
.venv/bin/buf format --diff --exit-code proto >/dev/null || { echo "run: .venv/bin/buf format -w proto" >&2; exit 1; }
.venv/bin/buf generate
.venv/bin/python scripts/fix_python_gen.py gen/python/engine_proto
