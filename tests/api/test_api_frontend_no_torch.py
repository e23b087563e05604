"""Frontend processes never load torch: only the engine core does (--in-process-engine may: it runs the core).

Real `engine-server` processes on the tiny model, after serving text, chat and tokenizer calls: every process
that listens on the gRPC port is a frontend, and none of them has libtorch mapped; the core (the control that
the check sees torch at all) does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from apiutil import CALL_TIMEOUT_S, greedy_request
from engine_proto.engine.v1 import generate_pb2, info_pb2, tokenize_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from grpclib.client import Channel
from serverproc import RunningServer, start_servers

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")

NUM_CONNECTIONS = 4  # SO_REUSEPORT spreads connections over the frontends of --api-workers
_TCP_LISTEN = "0A"


def _process_tree(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task").iterdir()
    children = [int(c) for task in tasks for c in (task / "children").read_text().split()]
    return [pid, *(p for child in children for p in _process_tree(child))]


def _listening_socket_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        if not table.exists():
            continue
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            local_address, state, inode = fields[1], fields[3], fields[9]
            if state == _TCP_LISTEN and int(local_address.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes


def _listens_on(pid: int, inodes: set[str]) -> bool:
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:[") and target.removeprefix("socket:[").removesuffix("]") in inodes:
            return True
    return False


def _has_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


async def _serve_a_bit(server: RunningServer) -> None:
    """Every frontend path that might import lazily: text and chat prompts, tokenizer RPCs, model info."""
    channels = [Channel("127.0.0.1", server.port) for _ in range(NUM_CONNECTIONS)]
    try:
        for channel in channels:
            stub = EngineServiceStub(channel)
            await stub.GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S)
            responses = await stub.Generate(greedy_request(text="Hello there", max_tokens=4),
                                            timeout=CALL_TIMEOUT_S)
            assert responses[-1].completions[0].finish_reason
            chat = generate_pb2.ChatMessages()
            chat.messages.add(role="user", content="Hello!")
            await stub.Generate(generate_pb2.GenerateRequest(chat=chat), timeout=CALL_TIMEOUT_S)
            tokens = await stub.Tokenize(tokenize_pb2.TokenizeRequest(text="Hello"), timeout=CALL_TIMEOUT_S)
            await stub.Detokenize(tokenize_pb2.DetokenizeRequest(token_ids=tokens.token_ids),
                                  timeout=CALL_TIMEOUT_S)
    finally:
        for channel in channels:
            channel.close()


async def test_frontends_never_load_torch_and_the_core_does() -> None:
    modes = [(), ("--api-workers", "2")]
    servers = start_servers(len(modes), per_server_args=modes)
    try:
        torch_by_mode: dict[tuple[str, ...], tuple[list[bool], list[bool]]] = {}
        for mode, server in zip(modes, servers, strict=True):
            await _serve_a_bit(server)
            inodes = _listening_socket_inodes(server.port)
            frontends: list[int] = []
            others: list[int] = []
            for pid in _process_tree(server.process.pid):
                (frontends if _listens_on(pid, inodes) else others).append(pid)
            torch_by_mode[mode] = ([_has_torch(pid) for pid in frontends],
                                   sorted(_has_torch(pid) for pid in others))
    finally:
        codes = [server.stop() for server in servers]
    assert codes == [0] * len(modes)
    # (each frontend, the other processes sorted: multiprocessing's resource tracker, then the core)
    assert torch_by_mode[()] == ([False], [False, True])
    assert torch_by_mode[("--api-workers", "2")] == ([False, False], [False, True])  # one shared core
