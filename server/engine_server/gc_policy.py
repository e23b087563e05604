"""Garbage-collector policy of the server's long-lived processes (frontends and engine core).

NOTE: after start-up a process holds a few hundred thousand long-lived objects (grpclib, h2, protobuf,
transformers' tokenizer code; torch in the engine core). CPython's full (generation 2) collection walks
all of them: measured 130-240 ms per pass in the frontend under load, each one a pause in every stream
(the TTFT p99 of a 256-stream benchmark was set by these pauses). `gc.freeze()` moves what exists at the
end of start-up into the permanent generation, so later full passes only walk what requests allocate.

Then the young generations: with CPython's default thresholds (700, 10, 10) a collection of generation 0
runs every 700 net allocations, and at 256 streams each one finds the live requests' fresh objects, promotes
them, and generation 1 walks them again: 7-12% of the frontend's time (measured with gc.callbacks on the
simulated engine, 256 streams: 12% with 1-token requests, 7.5% with 100-token ones). A request's objects die
by reference counting when it ends, so net allocations only grow while the live set grows; at 50,000 the
collector runs when it has something to find (cycles that reference counting cannot free wait at most that
many objects) and took ~0% of the time in the same runs (1-token requests: ~+10% requests/s).
"""

from __future__ import annotations

import gc

# generation 0 after this many net allocations, 1 after 20 of those, 2 after 10 of those (and, as CPython
# always does, only once the objects awaiting a full pass are a quarter of the long-lived ones)
SERVING_THRESHOLDS = (50_000, 20, 10)


def freeze_startup_heap() -> None:
    """Collect start-up garbage once, exempt every surviving object from future collections, then collect the
    young generations at SERVING_THRESHOLDS."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_THRESHOLDS)
