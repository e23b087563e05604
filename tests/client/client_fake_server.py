"""An in-test engine.v1 server with a fake servicer (grpclib, on its own thread and loop) for client tests.

It generates deterministic tokens, records every request and its metadata, can be told to fail the next calls
with given statuses, and can hang a Generate until it is cancelled or aborted (observable from any thread).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from engine_proto.engine.v1 import adapters_pb2, cache_pb2, embed_pb2, generate_pb2, info_pb2, tokenize_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceBase
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.health.service import Health
from grpclib.server import Server, Stream

VOCAB = 1000
EOS = 999


def fake_tokens(prompt_ids: list[int], index: int, count: int) -> list[int]:
    """The completion the fake generates: deterministic in the prompt and the completion index."""
    base = (sum(prompt_ids) + 7 * index) % 900
    return [(base + k) % 900 + 1 for k in range(count)]


def fake_text(token_id: int) -> str:
    return f"<{token_id}>"


@dataclass
class FakeState:
    """What the fake saw and what it is told to do; safe to read from the test's thread."""

    requests: list[Any] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    failures: deque[tuple[Status, str]] = field(default_factory=deque)
    hang_after: int | None = None  # Generate: stream this many chunks, then wait for cancel/abort
    fail_after: tuple[int, Status] | None = None  # Generate: stream this many chunks, then fail
    cancelled: threading.Event = field(default_factory=threading.Event)
    hanging: threading.Event = field(default_factory=threading.Event)
    in_flight: dict[str, asyncio.Event] = field(default_factory=dict)

    def reset(self) -> None:
        self.requests.clear()
        self.metadata.clear()
        self.failures.clear()
        self.hang_after = None
        self.fail_after = None
        self.cancelled.clear()
        self.hanging.clear()


class FakeEngineService(EngineServiceBase):
    def __init__(self, state: FakeState) -> None:
        self.state = state

    async def _begin(self, stream: Stream[Any, Any]) -> Any:
        request = await stream.recv_message()
        self.state.requests.append(request)
        self.state.metadata.append({k: str(v) for k, v in (stream.metadata or {}).items()})
        if self.state.failures:
            status, message = self.state.failures.popleft()
            raise GRPCError(status, message)
        return request

    async def Generate(self, stream: Stream[Any, Any]) -> None:
        req: generate_pb2.GenerateRequest = await self._begin(stream)
        rid = req.request_id or "server-assigned"
        prompt = list(req.token_ids.ids) if req.WhichOneof("input") == "token_ids" else [len(req.text)]
        n = req.sampling.n if req.sampling.HasField("n") else 1
        max_tokens = req.stopping.max_tokens if req.stopping.HasField("max_tokens") else 4
        abort = asyncio.Event()
        self.state.in_flight[rid] = abort
        try:
            await self._stream_tokens(stream, req, rid, prompt, n, max_tokens, abort)
        except asyncio.CancelledError:
            self.state.cancelled.set()
            raise
        finally:
            self.state.in_flight.pop(rid, None)

    async def _stream_tokens(self, stream: Stream[Any, Any], req: generate_pb2.GenerateRequest, rid: str,
                             prompt: list[int], n: int, max_tokens: int, abort: asyncio.Event) -> None:
        completions = [fake_tokens(prompt, i, max_tokens) for i in range(n)]
        want_lp = req.output.HasField("logprobs")
        if not req.stream:
            resp = generate_pb2.GenerateResponse(request_id=rid)
            for i, ids in enumerate(completions):
                c = resp.completions.add(index=i, token_ids=ids, text="".join(map(fake_text, ids)),
                                         finish_reason=generate_pb2.FINISH_REASON_LENGTH)
                if want_lp:
                    for t in ids:
                        c.logprobs.add(token_id=t, logprob=-0.5, rank=1).top.add(token_id=t, logprob=-0.5)
            resp.usage.prompt_tokens = len(prompt)
            resp.usage.completion_tokens = n * max_tokens
            await stream.send_message(resp)
            return
        for step in range(max_tokens):
            if self.state.fail_after is not None and step == self.state.fail_after[0]:
                raise GRPCError(self.state.fail_after[1], "fake failure mid-stream")
            if self.state.hang_after is not None and step == self.state.hang_after:
                self.state.hanging.set()
                await abort.wait()
                resp = generate_pb2.GenerateResponse(request_id=rid)
                for i in range(n):
                    resp.completions.add(index=i, finish_reason=generate_pb2.FINISH_REASON_ABORT)
                resp.usage.prompt_tokens = len(prompt)
                resp.usage.completion_tokens = n * step
                await stream.send_message(resp)
                return
            resp = generate_pb2.GenerateResponse(request_id=rid)
            last = step == max_tokens - 1
            for i, ids in enumerate(completions):
                c = resp.completions.add(index=i, token_ids=[ids[step]], text=fake_text(ids[step]))
                if want_lp:
                    c.logprobs.add(token_id=ids[step], logprob=-0.25, rank=1)
                if last:
                    c.finish_reason = generate_pb2.FINISH_REASON_LENGTH
            if last:
                resp.usage.prompt_tokens = len(prompt)
                resp.usage.completion_tokens = n * max_tokens
            await stream.send_message(resp)

    async def Embed(self, stream: Stream[Any, Any]) -> None:
        req: embed_pb2.EmbedRequest = await self._begin(stream)
        resp = embed_pb2.EmbedResponse()
        for item in req.inputs:
            size = len(item.text) if item.WhichOneof("input") == "text" else len(item.token_ids.ids)
            resp.embeddings.add(values=[float(size), 0.5, -0.5], num_tokens=size)
        resp.usage.prompt_tokens = sum(e.num_tokens for e in resp.embeddings)
        await stream.send_message(resp)

    async def Tokenize(self, stream: Stream[Any, Any]) -> None:
        req: tokenize_pb2.TokenizeRequest = await self._begin(stream)
        resp = tokenize_pb2.TokenizeResponse(token_ids=[ord(ch) for ch in req.text])
        if req.return_offsets:
            for i in range(len(req.text)):
                resp.offsets.add(start=i, end=i + 1)
        await stream.send_message(resp)

    async def Detokenize(self, stream: Stream[Any, Any]) -> None:
        req: tokenize_pb2.DetokenizeRequest = await self._begin(stream)
        text = "".join(chr(t) for t in req.token_ids)
        await stream.send_message(tokenize_pb2.DetokenizeResponse(text=text))

    async def Abort(self, stream: Stream[Any, Any]) -> None:
        req: generate_pb2.AbortRequest = await self._begin(stream)
        aborted = [rid for rid in req.request_ids if rid in self.state.in_flight]
        for rid in aborted:
            self.state.in_flight[rid].set()
        await stream.send_message(generate_pb2.AbortResponse(aborted_request_ids=aborted))

    async def GetModelInfo(self, stream: Stream[Any, Any]) -> None:
        await self._begin(stream)
        resp = info_pb2.GetModelInfoResponse(served_model_name="fake", architecture="FakeForCausalLM",
                                             task=info_pb2.MODEL_TASK_GENERATE, vocab_size=VOCAB,
                                             max_context_length=128, dtype="float32", device="cpu")
        resp.special_tokens.eos_token_ids.append(EOS)
        resp.special_tokens.bos_token_id = 0
        await stream.send_message(resp)

    async def GetServerInfo(self, stream: Stream[Any, Any]) -> None:
        await self._begin(stream)
        resp = info_pb2.GetServerInfoResponse(server_version="0.0.0", api_version="engine.v1",
                                              uptime_seconds=1.5, state=info_pb2.ENGINE_STATE_SERVING)
        resp.load.num_running_requests = len(self.state.in_flight)
        resp.limits.max_num_seqs = 8
        await stream.send_message(resp)

    async def GetLoad(self, stream: Stream[Any, Any]) -> None:
        await self._begin(stream)
        resp = info_pb2.GetLoadResponse(state=info_pb2.ENGINE_STATE_SERVING)
        resp.load.num_running_requests = len(self.state.in_flight)
        await stream.send_message(resp)

    async def FlushCache(self, stream: Stream[Any, Any]) -> None:
        await self._begin(stream)
        await stream.send_message(cache_pb2.FlushCacheResponse(num_blocks_flushed=0))

    async def SubscribeCacheEvents(self, stream: Stream[Any, Any]) -> None:
        # An empty cache: the snapshot (one part, a clear), then nothing.
        await self._begin(stream)
        resp = cache_pb2.SubscribeCacheEventsResponse(sequence_number=1, instance_id="fake")
        resp.events.add().cleared.SetInParent()
        resp.snapshot.count = 1
        await stream.send_message(resp)

    # LoRA adapters: loaded by name, rank 8 on q/v, nothing read
    async def LoadAdapter(self, stream: Stream[Any, Any]) -> None:
        req: adapters_pb2.LoadAdapterRequest = await self._begin(stream)
        resp = adapters_pb2.LoadAdapterResponse()
        resp.adapter.name, resp.adapter.rank, resp.adapter.lora_alpha = req.name, 8, 16.0
        resp.adapter.target_modules.extend(["q_proj", "v_proj"])
        await stream.send_message(resp)

    async def UnloadAdapter(self, stream: Stream[Any, Any]) -> None:
        await self._begin(stream)
        await stream.send_message(adapters_pb2.UnloadAdapterResponse())

    async def ListAdapters(self, stream: Stream[Any, Any]) -> None:
        await self._begin(stream)
        await stream.send_message(adapters_pb2.ListAdaptersResponse())


@dataclass(frozen=True, slots=True)
class FakeServer:
    state: FakeState
    port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextmanager
def run_fake_server() -> Iterator[FakeServer]:
    """Serve the fake on 127.0.0.1 (a free port) from a background thread; stops on exit."""
    state = FakeState()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    servers: list[Server] = []

    def serve() -> None:
        asyncio.set_event_loop(loop)

        async def start() -> None:
            # NOTE: grpclib binds the Server to the loop current at construction: build it on this thread.
            server = Server([FakeEngineService(state), Health()])
            await server.start("127.0.0.1", 0)
            servers.append(server)

        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name="fake-engine-server", daemon=True)
    thread.start()
    if not ready.wait(timeout=10):
        raise RuntimeError("fake server did not start")
    server = servers[0]
    port: int = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield FakeServer(state, port)
    finally:
        async def stop() -> None:
            server.close()
            await server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
