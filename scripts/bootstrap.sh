#!/usr/bin/env bash
# Installs everything the project needs into project-local folders, idempotently:
#   .venv/          Python (server, client, generated code, dev tools, torch)
#   .tools/go/bin   Go protoc plugins and CLI tools (grpcurl, grpc-health-probe)
#   .tools/cargo    Rust protoc plugins
# Every tool is pinned here; a warm run only checks what is already present.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

PROTOC_GEN_GO_VERSION=v1.36.11
PROTOC_GEN_GO_GRPC_VERSION=v1.6.1
GRPCURL_VERSION=v1.9.3
GRPC_HEALTH_PROBE_VERSION=v0.4.42
STATICCHECK_VERSION=v0.8.2
PROTOC_GEN_PROST_VERSION=0.5.0
PROTOC_GEN_TONIC_VERSION=0.5.0

log() { printf '[bootstrap] %s\n' "$*" >&2; }

python_env() {
  if [ ! -x .venv/bin/python ]; then
    log "creating .venv"
    python3.11 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip "uv==0.9.*"
  fi
  local stamp=.venv/.bootstrap-stamp
  local want
  want=$(cat pyproject.toml server/pyproject.toml clients/python/pyproject.toml gen/python/pyproject.toml \
    requirements-dev.txt 2>/dev/null | sha256sum | cut -d' ' -f1 || true)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return
  fi
  log "installing Python packages (torch is large on a fresh machine)"
  local pkgs=(-r requirements-dev.txt)
  [ -f gen/python/pyproject.toml ] && pkgs+=(-e gen/python)
  [ -f clients/python/pyproject.toml ] && pkgs+=(-e clients/python)
  [ -f server/pyproject.toml ] && pkgs+=(-e "server")
  # NOTE: --compile-bytecode: where PYTHONDONTWRITEBYTECODE is set (this CI machine sets it), Python never
  # caches what it compiles, and every process compiled torch/transformers from source again (import 8.8 s
  # instead of 3.8 s, for each server, engine core and test process).
  VIRTUAL_ENV="$root/.venv" .venv/bin/uv pip install -q --compile-bytecode "${pkgs[@]}"
  echo "$want" > "$stamp"
}

go_tools() {
  export GOBIN="$root/.tools/go/bin"
  mkdir -p "$GOBIN"
  local spec
  for spec in \
    "protoc-gen-go google.golang.org/protobuf/cmd/protoc-gen-go@$PROTOC_GEN_GO_VERSION" \
    "protoc-gen-go-grpc google.golang.org/grpc/cmd/protoc-gen-go-grpc@$PROTOC_GEN_GO_GRPC_VERSION" \
    "grpcurl github.com/fullstorydev/grpcurl/cmd/grpcurl@$GRPCURL_VERSION" \
    "grpc-health-probe github.com/grpc-ecosystem/grpc-health-probe@$GRPC_HEALTH_PROBE_VERSION" \
    "staticcheck honnef.co/go/tools/cmd/staticcheck@$STATICCHECK_VERSION"; do
    set -- $spec
    local stamp="$GOBIN/.$1.version"
    if [ -x "$GOBIN/$1" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$2" ]; then continue; fi
    log "go install $2"
    go install "$2"
    echo "$2" > "$stamp"
  done
}

cargo_tools() {
  local dir="$root/.tools/cargo"
  mkdir -p "$dir"
  local spec
  for spec in "protoc-gen-prost $PROTOC_GEN_PROST_VERSION" "protoc-gen-tonic $PROTOC_GEN_TONIC_VERSION"; do
    set -- $spec
    if [ -x "$dir/bin/$1" ] && [ "$(cat "$dir/.$1.version" 2>/dev/null)" = "$2" ]; then continue; fi
    log "cargo install $1 $2"
    cargo install --quiet --locked --root "$dir" "$1" --version "$2"
    echo "$2" > "$dir/.$1.version"
  done
}

what=${1:-all}
case "$what" in
  python) python_env ;;
  go) go_tools ;;
  cargo) cargo_tools ;;
  all) python_env; go_tools; cargo_tools ;;
  *) echo "usage: $0 [all|python|go|cargo]" >&2; exit 2 ;;
esac
