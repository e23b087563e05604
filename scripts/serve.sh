#!/usr/bin/env bash
# Starts engine-server (default: the embedded tiny demo model, random weights) after installing what is missing.
# Extra arguments go to engine-server, e.g. `scripts/serve.sh --port 50052 --model /path/to/model`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/bootstrap.sh" python
exec "$root/.venv/bin/engine-server" "$@"
