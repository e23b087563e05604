#!/usr/bin/env python3
"""The HTTP/SSE reference server, for the frontend benchmark ONLY: an OpenAI-style streaming /v1/completions
(uvicorn + starlette, JSON chunks as Server-Sent Events) on the same `AsyncEngine` handle as engine-server.

Deliberately straightforward, as an OpenAI-compatible server would be written: one JSON event per engine
output, `data: [DONE]` at the end, uvicorn with uvloop + httptools, access log off.

Usage: sse_server.py [--model PATH] [--simulated-engine STEP_MS] [--port 0] [--ready-file PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn
from engine_server.engine.types import EngineDead, EngineOverloaded, RequestError, SamplingParams
from engine_server.frontend.async_engine import AsyncEngine
from engine_server.frontend.outputs import GenerateRequest
from frontend_lib.engine_args import add_engine_args, resolve_model, start_engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


def build_app(engine: AsyncEngine, *, model_name: str) -> Starlette:
    async def completions(request: Request) -> Response:
        body = await request.json()
        try:
            params = SamplingParams(
                temperature=float(body.get("temperature", 1.0)), max_tokens=body.get("max_tokens", 16),
                ignore_eos=bool(body.get("ignore_eos", False)), n=int(body.get("n", 1)),
            )
            request_id = f"cmpl-{uuid.uuid4().hex}"
            outputs = engine.generate(GenerateRequest(request_id, tuple(body["prompt"]), params))
        except (RequestError, KeyError, TypeError, ValueError) as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error"}}, 400)
        except (EngineOverloaded, EngineDead) as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "server_error"}}, 503)
        created = int(time.time())

        async def events() -> AsyncIterator[str]:
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    choices = [
                        {"index": chunk.index, "text": chunk.text, "token_ids": chunk.token_ids,
                         "finish_reason": None if chunk.finish_reason is None
                         else _FINISH[chunk.finish_reason.value]}
                        for chunk in output.chunks
                    ]
                    event: dict[str, object] = {"id": request_id, "object": "text_completion",
                                                "created": created, "model": model_name, "choices": choices}
                    if output.finished:
                        completion_tokens = sum(c.num_completion_tokens for c in output.chunks)
                        event["usage"] = {"prompt_tokens": output.num_prompt_tokens,
                                          "completion_tokens": completion_tokens}
                    yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/health", health)])


async def serve(args: argparse.Namespace) -> None:
    engine = await start_engine(args)
    sock = socket.create_server((args.host, args.port), backlog=1024)
    server = uvicorn.Server(uvicorn.Config(
        build_app(engine, model_name=Path(args.model).name), loop="none", http="httptools",
        access_log=False, log_level="warning", timeout_keep_alive=60,
    ))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            serving.result()
            return
        await asyncio.sleep(0.05)
    if args.ready_file:
        tmp = f"{args.ready_file}.tmp"
        Path(tmp).write_text(json.dumps({"port": sock.getsockname()[1], "pid": os.getpid()}))
        os.replace(tmp, args.ready_file)
    await serving
    await engine.shutdown(timeout=5.0)


def main() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ready-file", default=None)
    args = p.parse_args()
    resolve_model(args)
    import uvloop

    uvloop.run(serve(args))
    sys.exit(0)


if __name__ == "__main__":
    main()
