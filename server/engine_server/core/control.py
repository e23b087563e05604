"""The control socket between the primary frontend and a shared core: a frontend that joins later (the
primary's replacement for a worker that died) arrives as one message, its number with its pipe's descriptor
(SCM_RIGHTS).
"""

from __future__ import annotations

import os
import socket
import struct
from multiprocessing.connection import Connection

_FRONTEND_NUMBER = struct.Struct("!I")  # a control message: the frontend's number, with its pipe's descriptor


def send_frontend_pipe(control: socket.socket, frontend: int, conn: Connection) -> None:
    """The primary's side: frontend number `frontend` is served over `conn` (whose descriptor the core gets a
    copy of; close it after). Raises OSError when the core is gone."""
    socket.send_fds(control, [_FRONTEND_NUMBER.pack(frontend)], [conn.fileno()])


def receive_frontend_pipe(control: socket.socket) -> tuple[int, Connection] | None:
    """The core's side: the next frontend's number and pipe, or None for a malformed message (dropped).
    Raises EOFError once the primary has closed its end: no more frontends will come."""
    try:
        data, fds, _flags, _address = socket.recv_fds(control, _FRONTEND_NUMBER.size, 1)
    except OSError:
        data, fds = b"", []
    if len(data) != _FRONTEND_NUMBER.size or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        if not data:
            raise EOFError("control socket closed")
        return None
    (index,) = _FRONTEND_NUMBER.unpack(data)
    return index, Connection(fds[0])
