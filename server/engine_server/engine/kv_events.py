"""The prefix cache's changes as events: blocks stored, blocks removed, the cache cleared (issue 40).

The block manager reports every change to its `CacheEventLog`; the log keeps them only while it records (the
core turns it on while a frontend subscribes), so an engine nobody watches pays one attribute test per block
stored or evicted. The core loop takes one step's events at a time (`take`) and publishes them as one batch.

Events are NamedTuples of ints, tuples and strings: they pickle in C across the pipe, and a stored event
refers to the token tuples the block manager made for its own lookup (no per-token work here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class BlocksStored(NamedTuple):
    """A chain of full blocks of one sequence that became reusable, first block first."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None  # the block before the first one; None: the first block starts its sequence
    token_ids: tuple[tuple[int, ...], ...]  # each block's tokens
    cache_salt: str  # "" for the shared namespace


class BlocksRemoved(NamedTuple):
    """Blocks that stopped being reusable (their memory was taken for other tokens)."""

    block_hashes: tuple[int, ...]


class CacheCleared(NamedTuple):
    """Every block stopped being reusable (a flush)."""


CacheEvent = BlocksStored | BlocksRemoved | CacheCleared


class CacheEventLog:
    """One step's prefix-cache events, in order, while recording; nothing at all otherwise."""

    __slots__ = ("_events", "_removed", "is_recording")

    def __init__(self) -> None:
        self.is_recording = False
        self._events: list[CacheEvent] = []
        # Consecutive removals become one event (an eviction wave is one event, not one per block).
        self._removed: list[int] = []

    def start(self) -> None:
        self.is_recording = True

    def stop(self) -> None:
        self.is_recording = False
        self._events = []
        self._removed = []

    def stored(self, block_hashes: list[int], parent_hash: int | None, token_ids: list[tuple[int, ...]],
               cache_salt: str) -> None:
        if self._removed:
            self._close_removed()
        self._events.append(BlocksStored(tuple(block_hashes), parent_hash, tuple(token_ids), cache_salt))

    def removed(self, block_hash: int) -> None:
        self._removed.append(block_hash)

    def cleared(self) -> None:
        # NOTE: what came before a clear is moot to a subscriber that applies the batch in order, but it is
        # kept: a batch is the step's history, and the removals are already in the list.
        if self._removed:
            self._close_removed()
        self._events.append(CacheCleared())

    def take(self) -> list[CacheEvent]:
        """The events since the last take, in order (empty when nothing changed)."""
        if self._removed:
            self._close_removed()
        events, self._events = self._events, []
        return events

    def _close_removed(self) -> None:
        self._events.append(BlocksRemoved(tuple(self._removed)))
        self._removed = []


CachedBlock = tuple[int, int | None, tuple[int, ...], str]  # (hash, parent hash, tokens, salt)


def snapshot_events(blocks: Sequence[CachedBlock]) -> list[CacheEvent]:
    """A whole cache as events: a clear, then every block stored, parents before children, chains grouped.

    NOTE: a block whose parent is not cached (evicted first, or stored after a flush) is listed as it was
    stored, naming that parent: a subscriber treats it as its own chain, as it did when it was stored.
    """
    by_hash = {block[0]: block for block in blocks}
    events: list[CacheEvent] = [CacheCleared()]
    emitted: set[int] = set()
    run: list[CachedBlock] = []

    def close_run() -> None:
        if run:
            events.append(BlocksStored(tuple(b[0] for b in run), run[0][1], tuple(b[2] for b in run),
                                       run[0][3]))
            run.clear()

    for block in blocks:
        if block[0] in emitted:
            continue
        # 1) the ancestors not listed yet, nearest first (bounded: a chain of n blocks has n - 1 parents)
        chain = [block]
        parent = block[1]
        while (parent is not None and parent in by_hash and parent not in emitted
               and len(chain) <= len(blocks)):
            chain.append(by_hash[parent])
            parent = by_hash[parent][1]
        # 2) listed from the oldest down; a block continues the run when it is the run's next link
        for item in reversed(chain):
            if item[0] in emitted:
                continue
            if not run or item[1] != run[-1][0] or item[3] != run[-1][3]:
                close_run()
            run.append(item)
            emitted.add(item[0])
    close_run()
    return events
