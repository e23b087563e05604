"""Garbage-collector policy of the server's long-lived processes (frontends and engine core).

NOTE: after start-up a process holds a few hundred thousand long-lived objects (grpclib, h2, protobuf,
transformers' tokenizer code; torch in the engine core). CPython's full (generation 2) collection walks
all of them: measured 130-240 ms per pass in the frontend under load, each one a pause in every stream
(the TTFT p99 of a 256-stream benchmark was set by these pauses). `gc.freeze()` moves what exists at the
end of start-up into the permanent generation, so later full passes only walk what requests allocate.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect start-up garbage once, then exempt every surviving object from future collections."""
    gc.collect()
    gc.freeze()
