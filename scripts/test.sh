#!/usr/bin/env bash
# The whole test suite, as CI runs it (`.ci/run` calls this): installs what is missing, then checks the contract,
# generated code, static analysis of every language, and runs the Python, Go and Rust tests.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export PATH="$root/.venv/bin:$root/.tools/go/bin:$root/.tools/cargo/bin:$PATH"
export CARGO_TARGET_DIR="$root/.tools/cargo-target"
export ENGINE_CACHE_DIR="${ENGINE_CACHE_DIR:-$root/.tools/model-cache}"
# torch's OpenMP threads spin while idle; on 2 shared cores that starves every other process of the suite.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"

step() { printf '\n==> %s\n' "$*"; }

step "install (pinned tools into .venv/ and .tools/)"
bash scripts/bootstrap.sh all

step "contract: buf format, lint, breaking (against the last released image)"
buf format --diff --exit-code
buf lint
latest=$(ls proto/releases/v*.binpb | sort -V | tail -n 1)
buf breaking --against "$latest"

step "generated code is in sync with proto/"
bash scripts/generate.sh
if [ -n "$(git status --porcelain -- gen/)" ]; then
  git status --porcelain -- gen/ >&2
  git diff --stat -- gen/ >&2
  echo "gen/ differs from what scripts/generate.sh produces: regenerate and commit" >&2
  exit 1
fi

step "Python: ruff and mypy (strict; generated code excluded)"
ruff check .
mypy server/engine_server clients/python/src scripts/fix_python_gen.py
# tests/: one run per folder, since pytest puts each folder on sys.path (helpers import by bare name) and every
# folder has its own `conftest` module; tests/ (serverproc, api.fakes) and bench/ (transport_lib) are on the path
for d in tests/ tests/[a-z]*/; do MYPYPATH=tests:bench mypy "$d"*.py; done

step "Go: vet, staticcheck, build"
(cd gen/go && go vet ./... && go build ./...)
if [ -f clients/go/go.mod ]; then
  (cd clients/go && go vet ./... && staticcheck ./... && go build ./...)
fi

step "Rust: clippy, build, docs"
(cd gen/rust && cargo clippy --locked -- -D warnings && cargo build --locked)
if [ -f clients/rust/Cargo.toml ]; then
  (cd clients/rust && cargo clippy --locked --all-targets -- -D warnings && cargo build --locked \
    && RUSTDOCFLAGS="-D warnings" cargo doc --locked --no-deps)
fi

step "Python tests"
# the engine's CPU kernels are compiled once per machine (~40 s); built here, so no server started by
# a test spends its start-up timeout compiling it
python -m engine_server.engine.cpu_kernels
python -m pytest tests -q -p no:cacheprovider

if [ -f clients/go/go.mod ]; then
  step "Go SDK tests"
  (cd clients/go && go test -count=1 ./...)
fi
if [ -f clients/rust/Cargo.toml ]; then
  step "Rust SDK tests"
  (cd clients/rust && cargo test --locked)
fi
step "all checks passed"
