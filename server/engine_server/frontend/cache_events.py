"""`CacheEventHub`: a frontend's copy of the engine's prefix-cache events, for its cache-event streams.

The hub subscribes to the core while any of its streams is open (and `linger_s` after the last one left, so a
client that reconnects at once can resume), keeps the cache's current state (a mirror built from the core's
snapshot and every batch since), the last `replay_batches` batches for resumes, and fans each batch out to
its subscriptions. Everything runs on the frontend's event loop; the core never waits for it, and it never
waits for a subscription: one whose unread batches pass `max_pending` is ended (`SubscriberFellBehind`)
and resubscribes (a replay, or a snapshot).

Cursors here are core numbers: `after` is the last batch a subscriber applied; the services translate
their own conventions (engine.v1: the next one wanted; vLLM's: the last applied, offset per instance).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from engine_server.core.cache_messages import CacheEventBatch, CacheEventsCommand, CacheEventsStart
from engine_server.engine.kv_events import (
    BlocksRemoved,
    BlocksStored,
    CachedBlock,
    CacheEvent,
    snapshot_events,
)
from engine_server.engine.types import EngineDead

logger = logging.getLogger(__name__)

REPLAY_BATCHES = 4096  # batches kept for resumes (a few seconds of a busy engine's steps)
MAX_PENDING = 1024  # unread batches at which a subscription is ended as fallen behind
MAX_SUBSCRIPTIONS = 64  # concurrent cache-event streams per frontend process
LINGER_S = 30.0  # the core subscription outlives the last stream this long (a reconnect resumes)


class CacheBatch(NamedTuple):
    """What a subscription yields: one published batch, or a snapshot (the whole state as of the number)."""

    sequence_number: int
    timestamp: float
    events: list[CacheEvent]
    is_snapshot: bool


class CursorOutOfRange(Exception):
    """A resume the hub cannot serve: batches after the cursor are gone (`is_future` False) or the cursor is
    past the last batch published (`is_future` True)."""

    def __init__(self, message: str, *, is_future: bool) -> None:
        super().__init__(message)
        self.is_future = is_future


class TooManySubscriptions(Exception):
    """The frontend's limit of concurrent cache-event streams is reached."""


class SubscriberFellBehind(Exception):
    """The subscription left more than `max_pending` batches unread; it has been ended."""


class CacheSubscription:
    """One stream's queue of batches. `close()` (or leaving its `with`) releases it; idempotent."""

    def __init__(self, hub: CacheEventHub, *, max_pending: int) -> None:
        self._hub = hub
        self._max_pending = max_pending
        self._pending: deque[CacheBatch] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._failure: Exception | None = None
        self.is_closed = False

    def push(self, batch: CacheBatch) -> None:
        if self._failure is not None:
            return
        if len(self._pending) >= self._max_pending:
            # NOTE: what it has not read is dropped now: a stuck stream holds at most max_pending batches.
            self._pending.clear()
            self.fail(SubscriberFellBehind(f"more than {self._max_pending} cache-event batches unread"))
            return
        self._pending.append(batch)
        self._wake()

    def fail(self, exc: Exception) -> None:
        if self._failure is None:
            self._failure = exc
            self._wake()

    async def get(self, timeout: float) -> list[CacheBatch]:  # noqa: ASYNC109 - the heartbeat cadence
        """Every batch not read yet, waiting up to `timeout` s for one (none came: an empty list).

        Raises what ended the subscription (SubscriberFellBehind, EngineDead) once it is read out."""
        if not self._pending and self._failure is None:
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await asyncio.wait_for(waiter, timeout)
            except TimeoutError:
                pass
            finally:
                self._waiter = None
        if self._pending:
            batches = list(self._pending)
            self._pending.clear()
            return batches
        if self._failure is not None:
            raise self._failure
        return []

    def close(self) -> None:
        if not self.is_closed:
            self.is_closed = True
            self._pending.clear()
            self._hub._release(self)

    def __enter__(self) -> CacheSubscription:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class CacheEventHub:
    """Started by AsyncEngine, which hands it the core's cache messages (`on_start`, `on_batch`)."""

    def __init__(self, send_command: Callable[[CacheEventsCommand], None], *,
                 replay_batches: int = REPLAY_BATCHES, max_pending: int = MAX_PENDING,
                 max_subscriptions: int = MAX_SUBSCRIPTIONS, linger_s: float = LINGER_S) -> None:
        self._send_command = send_command
        self._max_subscriptions = max_subscriptions
        self._max_pending = max_pending
        self._linger_s = linger_s
        self._subscriptions: set[CacheSubscription] = set()
        self._is_subscribed = False  # to the core (a command sent, not necessarily answered yet)
        self._started: asyncio.Future[None] | None = None  # done once the core's snapshot is here
        self._linger: asyncio.TimerHandle | None = None
        self._failure: EngineDead | None = None
        # The state as of batch `last_sequence_number`: the mirror (hash -> block), the batches after
        # the core's snapshot that are still kept.
        self._mirror: dict[int, CachedBlock] = {}
        self._replay: deque[CacheEventBatch] = deque(maxlen=replay_batches)
        self.instance_id = ""
        self.instance_started_us = 0
        self.block_size = 0
        self.last_sequence_number = 0
        self.last_batch_time = 0.0

    @property
    def num_subscriptions(self) -> int:
        return len(self._subscriptions)

    # --- streams ------------------------------------------------------------------------------------

    async def subscribe(self, position: Callable[[CacheEventHub], int | None]) -> CacheSubscription:
        """A subscription that starts with a snapshot (`position(hub)` None) or with the batches after the
        number it returns; `position` runs once the hub knows the engine instance (its `instance_id`,
        `instance_started_us`), so a service can translate its own cursor.

        Raises CursorOutOfRange (from the hub, or from `position`) for a resume it cannot serve,
        TooManySubscriptions past `max_subscriptions`, EngineDead when the engine is gone or draining. The
        subscription is registered before this returns: nothing published later is missed.
        """
        if self._failure is not None:
            raise self._failure
        if len(self._subscriptions) >= self._max_subscriptions:
            raise TooManySubscriptions(f"{self._max_subscriptions} cache-event streams are open already")
        subscription = CacheSubscription(self, max_pending=self._max_pending)
        self._subscriptions.add(subscription)  # NOTE: first, so the core subscription does not linger away
        try:
            await self._ensure_started()
            # NOTE: no await from here on: no batch can be published between the position and the replay
            self._start(subscription, position(self))
        except BaseException:
            subscription.close()
            raise
        return subscription

    def _start(self, subscription: CacheSubscription, after: int | None) -> None:
        last = self.last_sequence_number
        if after is None:
            subscription.push(self.snapshot())
            return
        if after > last:
            raise CursorOutOfRange(f"sequence number {after} is past the last batch published ({last})",
                                   is_future=True)
        first_kept = self._replay[0].sequence_number if self._replay else last + 1
        if after < first_kept - 1:
            raise CursorOutOfRange(f"the batches after {after} are no longer kept (the oldest kept is "
                                   f"{first_kept})", is_future=False)
        for batch in self._replay:
            if batch.sequence_number > after:
                subscription.push(CacheBatch(*batch, is_snapshot=False))

    def snapshot(self) -> CacheBatch:
        """The cache's state as of the last batch: a clear, then every block stored, parents first."""
        return CacheBatch(self.last_sequence_number, self.last_batch_time,
                          snapshot_events(list(self._mirror.values())), is_snapshot=True)

    async def _ensure_started(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if not self._is_subscribed:
            self._is_subscribed = True
            self._started = asyncio.get_running_loop().create_future()
            self._send_command(CacheEventsCommand(subscribe=True))
        started = self._started
        if started is not None and not started.done():
            # NOTE: shielded: one stream cancelled while waiting must not cancel the others' wait
            await asyncio.shield(started)
        if self._failure is not None:
            raise self._failure

    def _release(self, subscription: CacheSubscription) -> None:
        self._subscriptions.discard(subscription)
        if self._subscriptions or not self._is_subscribed or self._linger is not None:
            return
        if self._linger_s <= 0:
            self._unsubscribe()
        else:
            self._linger = asyncio.get_running_loop().call_later(self._linger_s, self._unsubscribe)

    def _unsubscribe(self) -> None:
        self._linger = None
        if self._subscriptions or not self._is_subscribed:
            return
        self._is_subscribed = False
        started, self._started = self._started, None
        if started is not None and not started.done():
            started.cancel()
        self._mirror = {}
        self._replay.clear()
        if self._failure is None:
            self._send_command(CacheEventsCommand(subscribe=False))

    # --- from the core --------------------------------------------------------------------------------

    def on_start(self, message: CacheEventsStart) -> None:
        started = self._started
        if not self._is_subscribed or started is None:
            return  # the answer to a subscription withdrawn since
        self.instance_id = message.instance_id
        self.instance_started_us = message.instance_started_us
        self.block_size = message.block_size
        self._mirror = {}
        self._replay.clear()
        self._apply(message.events)
        self.last_sequence_number = message.sequence_number
        if not started.done():
            started.set_result(None)

    def on_batch(self, message: CacheEventBatch) -> None:
        started = self._started
        if not self._is_subscribed or started is None or not started.done():
            return  # published before the core saw an unsubscribe, or before its answer to a new subscribe
        if message.sequence_number != self.last_sequence_number + 1:  # pragma: no cover - a core bug
            logger.error("cache events: batch %d after %d; resubscribing", message.sequence_number,
                         self.last_sequence_number)
            for subscription in list(self._subscriptions):
                subscription.fail(SubscriberFellBehind("the engine's cache events skipped a batch"))
            self._resubscribe()
            return
        self._apply(message.events)
        self.last_sequence_number = message.sequence_number
        self.last_batch_time = message.timestamp
        self._replay.append(message)
        batch = CacheBatch(*message, is_snapshot=False)
        for subscription in self._subscriptions:
            subscription.push(batch)

    def fail(self, exc: EngineDead) -> None:
        """The engine is gone or draining: every subscription ends with `exc`, and no new one starts."""
        if self._failure is not None:
            return
        self._failure = exc
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        started = self._started
        if started is not None and not started.done():
            started.set_result(None)  # (the waiters see the failure)
        for subscription in list(self._subscriptions):
            subscription.fail(exc)

    def _resubscribe(self) -> None:  # pragma: no cover - after a core bug only
        self._send_command(CacheEventsCommand(subscribe=False))
        self._started = asyncio.get_running_loop().create_future()
        self._send_command(CacheEventsCommand(subscribe=True))

    def _apply(self, events: list[CacheEvent]) -> None:
        mirror = self._mirror
        for event in events:
            if type(event) is BlocksStored:
                parent, salt = event.parent_hash, event.cache_salt
                for block_hash, tokens in zip(event.block_hashes, event.token_ids, strict=True):
                    mirror[block_hash] = (block_hash, parent, tokens, salt)
                    parent = block_hash
            elif type(event) is BlocksRemoved:
                for block_hash in event.block_hashes:
                    mirror.pop(block_hash, None)
            else:  # CacheCleared
                mirror.clear()

