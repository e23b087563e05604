"""The paged KV cache's bookkeeping: blocks are ints, a free list, ref counts and a prefix cache.

A full, computed block is registered under a chained hash of (previous block's hash, its tokens),
so a later sequence with the same prefix reuses it. Freed blocks keep their hash until they are
handed out again: a preempted or finished sequence's prefix stays reusable while memory allows.
A sequence's first block chains from its cache root (0, or its request's cache salt hashed), so
requests with different salts never share a block: the lookup walks from the first block.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from engine_server.engine.kv_events import CacheEventLog
from engine_server.engine.sequence import Sequence


def chain_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def cache_root(cache_salt: str) -> int:
    """The parent hash of a sequence's first block: 0 for the shared namespace, else the salt's digest.

    NOTE: a stable digest, not hash(str), which differs between processes (PYTHONHASHSEED); 0 is never a
    salted root, so a salted chain cannot meet the shared one at its first block.
    """
    if not cache_salt:
        return 0
    digest = hashlib.blake2b(cache_salt.encode(), digest_size=8, person=b"cache_salt").digest()
    return int.from_bytes(digest, "little", signed=True) or 1


class FreeBlocks:
    """The free block ids, the one freed longest ago first: a doubly linked list over two arrays made once.

    NOTE: O(1) to take the oldest, to add one as the newest and to take one out of the middle (a prefix-cache
    hit on a free block), with no allocation after construction. An OrderedDict did the same, but that churn
    (one key out at the front and one in at the back, per block used) made it rebuild its tables every ~27k
    frees: ~1.8 MB allocated anew each time at 16k blocks, and the core's heap keeps what it frees
    (malloc_policy.py): its RSS grew ~1.25 MB at each rebuild, ~40 bytes a request (issue 37, item 4).
    """

    __slots__ = ("_next", "_num_free", "_prev")

    def __init__(self, num_blocks: int) -> None:
        # Index num_blocks is the sentinel: its next is the oldest free block, its prev the newest; a block
        # that is not free has prev -1.
        self._next: list[int] = [*range(1, num_blocks + 1), 0]
        self._prev: list[int] = [num_blocks, *range(num_blocks)]
        self._num_free = num_blocks

    def __len__(self) -> int:
        return self._num_free

    def __contains__(self, block_id: object) -> bool:
        return type(block_id) is int and 0 <= block_id < len(self._prev) - 1 and self._prev[block_id] >= 0

    def __iter__(self) -> Iterator[int]:
        nxt = self._next
        sentinel = len(nxt) - 1
        block_id = nxt[sentinel]
        while block_id != sentinel:
            yield block_id
            block_id = nxt[block_id]

    def append(self, block_id: int) -> None:
        """Adds a block that is not free as the newest."""
        nxt, prev = self._next, self._prev
        sentinel = len(nxt) - 1
        newest = prev[sentinel]
        nxt[newest] = block_id
        prev[block_id] = newest
        nxt[block_id] = sentinel
        prev[sentinel] = block_id
        self._num_free += 1

    def remove(self, block_id: int) -> None:
        """Takes a free block out, wherever it is."""
        nxt, prev = self._next, self._prev
        before, after = prev[block_id], nxt[block_id]
        nxt[before] = after
        prev[after] = before
        prev[block_id] = -1
        self._num_free -= 1

    def pop_oldest(self) -> int:
        block_id = self._next[-1]
        if block_id == len(self._next) - 1:
            raise IndexError("no free block")
        self.remove(block_id)
        return block_id


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # NOTE: allocation takes the oldest and frees append as the newest, so the cached blocks freed
        # longest ago are evicted first (LRU). A linked list, not a deque: a prefix-cache hit on a free
        # block takes it out of the middle, which a deque did by a scan of every free block (~5% of a step
        # with 16k blocks when a wave of prompts hit the cache; a GPU's cache has 10x the blocks).
        self.free_block_ids = FreeBlocks(num_blocks)
        # Cache events (kv_events.py), recorded only while someone subscribes; a cached block's parent hash
        # (None: it starts its sequence) and salt, kept always, for the snapshot a new subscriber starts with.
        self.cache_events = CacheEventLog()
        self.block_parent: list[int | None] = [None] * num_blocks
        self.block_salt: list[str] = [""] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # 1) prefix cache lookup and admission
    def match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached blocks (and their hashes) for the longest run of full blocks of seq's tokens.

        At most num_tokens - 1 tokens are matched: the last token must be computed to get logits.
        """
        if not self.enable_prefix_caching:
            return [], []
        block_ids: list[int] = []
        hashes: list[int] = []
        parent = seq.cache_root
        size = self.block_size
        for start in range(0, seq.num_tokens - 1 - size + 1, size):
            tokens = tuple(seq.token_ids[start:start + size])
            h = chain_hash(parent, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.block_tokens[block_id] != tokens:
                break
            block_ids.append(block_id)
            hashes.append(h)
            parent = h
        return block_ids, hashes

    def can_admit(self, cached_block_ids: list[int], num_tokens: int) -> bool:
        """Whether the cached blocks plus new ones for num_tokens fit in the free list."""
        num_new = self.blocks_needed(num_tokens) - len(cached_block_ids)
        # A cached block with no owner sits in the free list: taking it uses a free slot.
        num_reused_free = sum(1 for b in cached_block_ids if self.ref_counts[b] == 0)
        return num_new + num_reused_free <= self.num_free_blocks

    def admit(self, seq: Sequence, cached_block_ids: list[int], hashes: list[int]) -> None:
        """Gives seq the cached blocks; the caller then calls ensure_blocks for the rest."""
        for block_id in cached_block_ids:
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.remove(block_id)
            self.ref_counts[block_id] += 1
        seq.block_table = list(cached_block_ids)
        seq.block_hashes = list(hashes)
        seq.num_computed_tokens = len(cached_block_ids) * self.block_size

    # 2) growth, registration, release
    def ensure_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Grows seq's block table to hold num_tokens; False (and no change) if memory is short."""
        num_missing = self.blocks_needed(num_tokens) - len(seq.block_table)
        if num_missing <= 0:
            return True
        if num_missing > self.num_free_blocks:
            return False
        for _ in range(num_missing):
            seq.block_table.append(self._take_free_block())
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publishes seq's newly full, computed blocks in the prefix cache."""
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        num_known = len(seq.block_hashes)
        size = self.block_size
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            tokens = tuple(seq.token_ids[i * size:(i + 1) * size])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else seq.cache_root, tokens)
            seq.block_hashes.append(h)
            if not self.enable_prefix_caching:
                continue
            block_id = seq.block_table[i]
            if h not in self.hash_to_block and self.block_hash[block_id] is None:
                self.hash_to_block[h] = block_id
                self.block_hash[block_id] = h
                self.block_tokens[block_id] = tokens
        if num_full > num_known and self.enable_prefix_caching:
            self._note_stored(seq, num_known, num_full)

    def _note_stored(self, seq: Sequence, first: int, end: int) -> None:
        """Blocks first..end-1 of seq just got their hashes: remember the parent and salt of those this call
        cached (others held the same hash already) and, while recording, report each run of them as one
        stored event."""
        block_hash, block_table, hashes = self.block_hash, seq.block_table, seq.block_hashes
        salt = seq.cache_salt
        log = self.cache_events if self.cache_events.is_recording else None
        run: list[int] = []
        run_start = first
        for i in range(first, end):
            block_id = block_table[i]
            if block_hash[block_id] != hashes[i]:  # not cached by this call: a run ends here
                if run and log is not None:
                    self._log_run(log, seq, run_start, run)
                run = []
                run_start = i + 1
                continue
            self.block_parent[block_id] = hashes[i - 1] if i else None
            self.block_salt[block_id] = salt
            run.append(block_id)
        if run and log is not None:
            self._log_run(log, seq, run_start, run)

    def _log_run(self, log: CacheEventLog, seq: Sequence, start: int, block_ids: list[int]) -> None:
        tokens = self.block_tokens
        log.stored(seq.block_hashes[start:start + len(block_ids)],
                   seq.block_hashes[start - 1] if start else None,
                   [t for b in block_ids if (t := tokens[b]) is not None], seq.cache_salt)

    def cached_blocks(self) -> list[tuple[int, int | None, tuple[int, ...], str]]:
        """Every cached block as (hash, parent hash, tokens, salt): what a snapshot lists."""
        parent, tokens, salt = self.block_parent, self.block_tokens, self.block_salt
        return [(h, parent[b], t, salt[b])
                for h, b in self.hash_to_block.items() if (t := tokens[b]) is not None]

    def share(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        """Gives child the parent's first num_blocks (full, computed) blocks: n>1 shares the prompt."""
        child.block_table = parent.block_table[:num_blocks]
        child.block_hashes = parent.block_hashes[:num_blocks]
        for block_id in child.block_table:
            self.ref_counts[block_id] += 1
        child.num_computed_tokens = num_blocks * self.block_size

    def free(self, seq: Sequence) -> None:
        # Reversed: a sequence's tail blocks are the least likely to be shared, so evict them first.
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    # 3) flush
    def flush(self) -> int:
        """Forgets every cached block; returns how many there were. Nothing is preempted or freed.

        Free cached blocks become plain free blocks; blocks in use keep their owners and content but are no
        longer found by a lookup (and are freed uncached), so nothing computed before the flush is reused.
        A running sequence's later blocks are still registered, but a lookup walks from a sequence's first
        block, so they cannot be reached until that block is stored again.
        """
        num_flushed = len(self.hash_to_block)
        for block_id in self.hash_to_block.values():
            self.block_hash[block_id] = None
            self.block_tokens[block_id] = None
        self.hash_to_block.clear()
        if self.cache_events.is_recording:
            self.cache_events.cleared()
        return num_flushed

    def _take_free_block(self) -> int:
        block_id = self.free_block_ids.pop_oldest()
        h = self.block_hash[block_id]
        if h is not None:  # evict its cached content
            if self.hash_to_block.get(h) == block_id:
                del self.hash_to_block[h]
                if self.cache_events.is_recording:
                    self.cache_events.removed(h)
            self.block_hash[block_id] = None
            self.block_tokens[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id
