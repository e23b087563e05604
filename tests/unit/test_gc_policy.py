"""gc_policy.freeze_startup_heap: start-up garbage is collected, then survivors leave the GC's walk; the young
generations are collected at the serving thresholds, and cycles made later are still collected."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# NOTE: in a child interpreter: freezing pytest's own heap would outlive this test.
_CHILD = textwrap.dedent("""
    import gc, weakref
    from engine_server.gc_policy import freeze_startup_heap

    class Node:
        pass

    garbage = Node(); garbage.self = garbage          # a cycle nothing refers to
    dead = weakref.ref(garbage); del garbage
    kept = [Node() for _ in range(1000)]              # live objects made at start-up
    assert gc.get_freeze_count() == 0
    freeze_startup_heap()
    assert dead() is None, "start-up garbage must be collected before freezing"
    assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()
    tracked = {id(o) for o in gc.get_objects()}
    assert not any(id(node) in tracked for node in kept), "frozen objects are not walked any more"
    from engine_server.gc_policy import SERVING_THRESHOLDS
    assert gc.get_threshold() == SERVING_THRESHOLDS
    # a cycle made while serving is found once net allocations pass the generation-0 threshold
    later = Node(); later.self = later
    dead_later = weakref.ref(later); del later
    churn = [Node() for _ in range(SERVING_THRESHOLDS[0] + 1000)]
    assert dead_later() is None, "a cycle made while serving must still be collected"
    print("ok")
""")


def test_freeze_collects_then_exempts_the_startup_heap() -> None:
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
