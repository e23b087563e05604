"""The frontend's side of the engine boundary: start the core (own process or own thread) and talk to it.

Transport: one duplex pipe (a Unix socketpair). The core uses a plain `multiprocessing` Connection; the
frontend reads and writes the same framing (4-byte big-endian length + pickle) on an asyncio transport, so the
event loop never blocks on the pipe: writes are buffered by the transport (a slow core cannot stall the loop,
and the two sides can never deadlock on full buffers). Messages are unpickled as their bytes arrive; a
frontend that fell behind takes every message already there in one go (`recv_ready`), so the outputs of
several engine steps reach a client as one message.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import threading
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, cast

from engine_server.core.loop import (
    EngineFactory,
    default_engine_factory,
    run_core,
    run_core_process,
)
from engine_server.core.messages import Command, CoreMessage, LoadFailed, Ready, ShutdownCommand
from engine_server.engine.types import EngineDead

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from engine_server.engine.config import EngineConfig

# NOTE: GNU OpenMP (torch's CPU threads) spins while it waits for work. With the frontend process, other
# processes or a loaded machine on the same cores, the spinning steals the CPU from the thread doing the
# work: measured on a 2-core machine, the tiny model's engine did 60-900 tok/s spinning and ~11,000 tok/s
# with PASSIVE waiting. It must be set before torch loads in the core process; a value the user set wins.
_CORE_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE"}

_HEADER = struct.Struct("!i")
_LONG_HEADER = struct.Struct("!Q")  # multiprocessing's framing for messages >= 2 GiB
# Unread messages at which the frontend stops reading the pipe: the core then blocks on its next send
# instead of the frontend buffering without bound.
_MAX_UNREAD = 64


class EngineLoadError(RuntimeError):
    """The engine core could not load the model; the message says why (e.g. a missing path)."""


class CoreGone(EngineDead):
    """The pipe to the core closed: the core exited or crashed."""


class CoreClient:
    """Owns the engine core (a spawned process, or a thread in in-process mode) and the pipe to it."""

    def __init__(
        self,
        *,
        pipe: _PipeProtocol,
        transport: asyncio.WriteTransport,
        process: BaseProcess | None,
        thread: threading.Thread | None,
    ) -> None:
        self._pipe = pipe
        self._writer = transport
        self._process = process
        self._thread = thread
        self._outbox: list[Command] = []
        self._loop = asyncio.get_running_loop()

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        *,
        in_process: bool = False,
        engine_factory: EngineFactory = default_engine_factory,
    ) -> tuple[CoreClient, Ready]:
        """Start the core and wait for its handshake. Raises EngineLoadError if the model does not load."""
        process: BaseProcess | None = None
        thread: threading.Thread | None = None
        if in_process:
            parent, child = multiprocessing.Pipe(duplex=True)
            thread = threading.Thread(
                target=run_core, args=([child], config, engine_factory), name="engine-core", daemon=True
            )
            thread.start()
        else:
            # NOTE: "spawn", not fork: the parent runs an event loop and threads; torch is not fork-safe.
            ctx = multiprocessing.get_context("spawn")
            parent, child = ctx.Pipe(duplex=True)
            process = ctx.Process(target=run_core_process, args=([child], config, engine_factory),
                                  name="engine-core", daemon=True)
            with core_environment():
                process.start()
            child.close()  # else the parent holds the child's end and never sees EOF when the core dies
        client = await cls.connect(parent, process=process, thread=thread)
        try:
            first = await client.recv()
        except asyncio.CancelledError:
            client.abandon()
            raise
        except CoreGone as exc:
            await client.close(timeout=5.0)
            suffix = client._exit_suffix()
            raise EngineLoadError(f"engine core exited while loading the model{suffix}") from exc
        if isinstance(first, LoadFailed):
            await client.close(timeout=5.0)
            raise EngineLoadError(f"cannot load model {config.model!r}: {first.error_type}: {first.message}")
        if not isinstance(first, Ready):  # pragma: no cover - protocol error
            await client.close(timeout=5.0)
            raise EngineLoadError(f"unexpected handshake message {type(first).__name__}")
        return client, first

    @classmethod
    async def connect(
        cls, conn: Connection, *, process: BaseProcess | None, thread: threading.Thread | None
    ) -> CoreClient:
        """Wraps the frontend's end of the pipe (the Connection is closed; its socket lives on)."""
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        conn.close()
        sock.setblocking(False)
        transport, pipe = await asyncio.get_running_loop().create_unix_connection(_PipeProtocol, sock=sock)
        return cls(pipe=pipe, transport=transport, process=process, thread=thread)

    # --- sending: every command queued in one loop tick goes out in one pickled write ---------------

    def send(self, command: Command) -> None:
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append(command)

    def _flush(self) -> None:
        commands, self._outbox = tuple(self._outbox), []
        if not commands or self._writer.is_closing():
            return
        data = pickle.dumps(commands, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > 0x7FFFFFFF:
            header = _HEADER.pack(-1) + _LONG_HEADER.pack(len(data))
        else:
            header = _HEADER.pack(len(data))
        self._writer.write(header + data)  # NOTE: one write is one send(); this runs on every loop tick

    # --- receiving ----------------------------------------------------------------------------------

    async def recv(self) -> CoreMessage:
        """The next message from the core; raises CoreGone when the pipe closes."""
        pipe = self._pipe
        while not pipe.messages:
            if pipe.failure is not None:
                raise CoreGone(f"the engine core exited{self._exit_suffix()}") from pipe.failure
            await pipe.wait()
        message = pipe.messages.popleft()
        pipe.maybe_resume()
        return message

    def recv_ready(self) -> list[CoreMessage]:
        """Every message that has already arrived (none: an empty list); never waits."""
        pipe = self._pipe
        messages = list(pipe.messages)
        pipe.messages.clear()
        pipe.maybe_resume()
        return messages

    # --- lifecycle ----------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def kill(self) -> None:
        """SIGKILL the core process (tests, or a core that ignores shutdown)."""
        if self._process is not None and self._process.is_alive():
            self._process.kill()

    def _exit_suffix(self) -> str:
        if self._process is None:
            return ""
        code = self._process.exitcode
        if code is None:
            return ""
        if code < 0:
            with contextlib.suppress(ValueError):
                return f" (killed by {signal.Signals(-code).name})"
        return f" (exit code {code})"

    async def reap(self, *, timeout: float) -> str:  # noqa: ASYNC109 - a join budget
        """After the pipe failed: wait for the core process's end (a core whose pipe broke while it runs on
        is killed after `timeout` s) and collect it, so it does not stay a zombie; returns how it ended
        (" (killed by SIGKILL)", or "" for a core thread)."""
        process = self._process
        if process is None:
            return ""
        await asyncio.to_thread(process.join, timeout)
        if process.is_alive():
            process.kill()
            await asyncio.to_thread(process.join, 5.0)
        return self._exit_suffix()

    def abandon(self) -> None:
        """Stop the core without waiting (a cancelled start): kill the process, or tell the thread to stop."""
        self.kill()
        if not self._writer.is_closing():
            self.send(ShutdownCommand())
            self._flush()
            self._writer.close()

    async def close(self, *, timeout: float) -> None:  # noqa: ASYNC109 - a join budget
        """Ask the core to stop, wait up to `timeout` seconds, then kill it."""
        if not self._writer.is_closing():
            self.send(ShutdownCommand())
            self._flush()
        if self._process is not None:
            process = self._process
            await asyncio.to_thread(process.join, timeout)
            if process.is_alive():
                process.kill()
                await asyncio.to_thread(process.join, 5.0)
        elif self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        self._writer.close()


def core_environment() -> contextlib.AbstractContextManager[None]:
    """Around the start of any engine core process (own or shared): `_CORE_ENVIRONMENT`'s defaults."""
    return _environment_defaults(_CORE_ENVIRONMENT)


@contextlib.contextmanager
def _environment_defaults(defaults: dict[str, str]) -> Iterator[None]:
    """Sets unset variables for the duration (the spawned process inherits the environment at start)."""
    added = [name for name in defaults if name not in os.environ]
    for name in added:
        os.environ[name] = defaults[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


class _PipeProtocol(asyncio.Protocol):
    """The frontend's end of the pipe: complete frames are unpickled as they arrive, in order."""

    def __init__(self) -> None:
        self.messages: deque[CoreMessage] = deque()
        self.failure: BaseException | None = None  # set once the pipe is closed (EOF, error, bad frame)
        self._transport: asyncio.ReadTransport | None = None
        self._buffer = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self._is_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.ReadTransport, transport)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        offset, end = 0, len(buffer)
        try:
            while end - offset >= _HEADER.size:
                (size,) = _HEADER.unpack_from(buffer, offset)
                start = offset + _HEADER.size
                if size == -1:
                    if end - start < _LONG_HEADER.size:
                        break
                    (size,) = _LONG_HEADER.unpack_from(buffer, start)
                    start += _LONG_HEADER.size
                if end - start < size:
                    break
                self.messages.append(pickle.loads(buffer[start:start + size]))
                offset = start + size
        except Exception as exc:  # a corrupt frame: nothing after it can be trusted
            self._fail(exc)
            if self._transport is not None:
                self._transport.close()
            return
        del buffer[:offset]
        if len(self.messages) >= _MAX_UNREAD and not self._is_paused and self._transport is not None:
            self._is_paused = True
            self._transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._fail(EOFError("the engine core closed the pipe"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionResetError("the pipe to the engine core closed"))

    async def wait(self) -> None:
        """Until a message arrives or the pipe fails."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    def maybe_resume(self) -> None:
        transport = self._transport
        if self._is_paused and len(self.messages) < _MAX_UNREAD // 2 and transport is not None:
            self._is_paused = False
            if not transport.is_closing():
                transport.resume_reading()

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
