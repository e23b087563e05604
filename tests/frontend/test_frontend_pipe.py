"""The frontend's end of the core pipe: multiprocessing framing parsed as bytes arrive, however split."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import struct
import threading
from multiprocessing.connection import Connection
from typing import cast

import pytest
from engine_server.frontend.core_process import _MAX_UNREAD, CoreClient, CoreGone

TIMEOUT = 10.0


def _frame(message: object) -> bytes:
    data = pickle.dumps(message)
    return struct.pack("!i", len(data)) + data


async def _client() -> tuple[CoreClient, Connection]:
    ours, theirs = multiprocessing.Pipe(duplex=True)
    return await CoreClient.connect(ours, process=None, thread=None), theirs


async def test_messages_from_a_multiprocessing_connection_arrive_in_order() -> None:
    client, core = await _client()
    messages = [("step", i, "x" * (i * 1000)) for i in range(20)]  # some span several reads
    for message in messages:
        core.send(message)
    async with asyncio.timeout(TIMEOUT):
        received: list[object] = [await client.recv()]  # the pipe carries any picklable object
        while len(received) < len(messages):
            received.extend(client.recv_ready() or [await client.recv()])
    assert received == messages
    core.close()
    with pytest.raises(CoreGone):
        async with asyncio.timeout(TIMEOUT):
            await client.recv()
    await client.close(timeout=1.0)


async def test_frames_split_anywhere_and_batched_are_parsed_exactly() -> None:
    client, core = await _client()
    raw = b"".join(_frame(i) for i in range(50))
    for start in range(0, len(raw), 7):  # raw bytes in odd-sized pieces, bypassing the Connection's framing
        os.write(core.fileno(), raw[start:start + 7])
    async with asyncio.timeout(TIMEOUT):
        received: list[object] = [await client.recv()]
        while len(received) < 50:
            received.extend(client.recv_ready() or [await client.recv()])
    assert received == list(range(50))
    core.close()
    await client.close(timeout=1.0)


async def test_many_unread_messages_pause_reading_and_lose_nothing() -> None:
    client, core = await _client()
    total, size = _MAX_UNREAD * 4, 16 * 1024

    def send_all() -> None:
        for i in range(total):
            core.send(("step", i, b"x" * size))

    sender = threading.Thread(target=send_all)
    sender.start()
    # NOTE: the time lets the loop read all it will; pausing must stop it near the bound (one read of up
    # to 256 KiB may complete a few more frames), so the core's sends block instead of piling up here.
    await asyncio.sleep(0.3)
    first = client.recv_ready()
    assert 0 < len(first) <= _MAX_UNREAD + 256 * 1024 // size + 1
    assert sender.is_alive()
    received: list[object] = list(first)
    async with asyncio.timeout(TIMEOUT):
        while len(received) < total:
            received.extend(client.recv_ready() or [await client.recv()])
    sender.join(TIMEOUT)
    assert [cast(tuple[str, int, bytes], message)[1] for message in received] == list(range(total))
    core.close()
    await client.close(timeout=1.0)


async def test_a_corrupt_frame_ends_the_pipe_with_core_gone() -> None:
    client, core = await _client()
    core.send("fine")
    os.write(core.fileno(), struct.pack("!i", 5) + b"\x00garb")
    async with asyncio.timeout(TIMEOUT):
        fine: object = await client.recv()
        assert fine == "fine"
        with pytest.raises(CoreGone):
            await client.recv()
    core.close()
    await client.close(timeout=1.0)
