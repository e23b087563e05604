"""The gRPC transport: grpclib, h2, hpack and hyperframe, and every use of their internals.

NOTE: this package is the only place in engine_server that touches a private name of those four packages
(private attributes, overridden private methods, private modules); their versions are pinned exactly in
server/pyproject.toml and requirements-dev.txt, and tests/security/test_transport_pins.py fails on any other
version until these modules are re-checked against it. scripts/count_private_names.py counts the names.
Everything outside this package uses their public API only.
"""

from __future__ import annotations

from grpclib._typing import IServable  # what grpclib's Server serves (a generated or hand-written servicer)

__all__ = ["IServable"]
