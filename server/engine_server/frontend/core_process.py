"""The frontend's side of the engine boundary: start the core (own process or own thread) and talk to it.

Transport: one duplex pipe (a Unix socketpair). The core uses a plain `multiprocessing` Connection; the
frontend reads and writes the same framing (4-byte big-endian length + pickle) with asyncio streams, so the
event loop never blocks on the pipe: writes are buffered by the transport (a slow core cannot stall the loop,
and the two sides can never deadlock on full buffers), reads are awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import pickle
import socket
import struct
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from engine_server.engine.types import EngineDead
from engine_server.frontend.core_loop import (
    EngineFactory,
    default_engine_factory,
    run_core,
    run_core_process,
)
from engine_server.frontend.messages import Command, CoreMessage, LoadFailed, Ready, ShutdownCommand

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


class EngineLoadError(RuntimeError):
    """The engine core could not load the model; the message says why (e.g. a missing path)."""


class CoreGone(EngineDead):
    """The pipe to the core closed: the core exited or crashed."""


class CoreClient:
    """Owns the engine core (a spawned process, or a thread in in-process mode) and the pipe to it."""

    def __init__(
        self,
        *,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        process: BaseProcess | None,
        thread: threading.Thread | None,
    ) -> None:
        self._reader = reader
        self._writer = writer
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
                target=run_core, args=(child, config, engine_factory), name="engine-core", daemon=True
            )
            thread.start()
        else:
            # NOTE: "spawn", not fork: the parent runs an event loop and threads; torch is not fork-safe.
            ctx = multiprocessing.get_context("spawn")
            parent, child = ctx.Pipe(duplex=True)
            process = ctx.Process(
                target=run_core_process, args=(child, config, engine_factory), name="engine-core", daemon=True
            )
            with core_environment():
                process.start()
            child.close()  # else the parent holds the child's end and never sees EOF when the core dies
        reader, writer = await _open_streams(parent)
        client = cls(reader=reader, writer=writer, process=process, thread=thread)
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
            self._writer.write(_HEADER.pack(-1) + _LONG_HEADER.pack(len(data)))
        else:
            self._writer.write(_HEADER.pack(len(data)))
        self._writer.write(data)

    # --- receiving ----------------------------------------------------------------------------------

    async def recv(self) -> CoreMessage:
        """The next message from the core; raises CoreGone when the pipe closes."""
        reader = self._reader
        try:
            (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
            if size == -1:
                (size,) = _LONG_HEADER.unpack(await reader.readexactly(_LONG_HEADER.size))
            data = await reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise CoreGone(f"the engine core exited{self._exit_suffix()}") from exc
        message: CoreMessage = pickle.loads(data)
        return message

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
        return f" (exit code {code})" if code is not None else ""

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


async def _open_streams(conn: Connection) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    conn.close()
    sock.setblocking(False)
    # NOTE: no read limit applies to readexactly; the limit only bounds readline-style reads.
    return await asyncio.open_unix_connection(sock=sock)
