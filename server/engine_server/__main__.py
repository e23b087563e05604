"""`python -m engine_server`: the same as the `engine-server` command."""

from __future__ import annotations

import sys

from engine_server.cli import main

if __name__ == "__main__":
    sys.exit(main())
