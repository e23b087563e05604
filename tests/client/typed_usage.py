"""A sample program using engine-client, checked with `mypy --strict` by test_client_typing.py.

It is never run: it exists to prove the client's types are real (no Any leaking into user code). Each
`reveal`-style assignment below pins a precise type; a wrong one fails the mypy run.
"""

from __future__ import annotations

import asyncio

from engine_client import (
    AsyncEngineClient,
    Choice,
    ConnectionOptions,
    EngineClient,
    EngineError,
    FinishReason,
    GenerateChunk,
    GenerateParams,
    GenerateResult,
    HealthStatus,
    JsonSchema,
    OverloadedError,
    RetryPolicy,
    StructuralTag,
    StructuredOutput,
    Tag,
    TLSConfig,
    Usage,
)


def sync_main(target: str) -> list[int]:
    options = ConnectionOptions(target, api_key="key", timeout=30.0, retry=RetryPolicy(max_attempts=5),
                                tls=TLSConfig(ca_file="ca.pem"))
    with EngineClient(options) as client:
        ids: list[int] = []
        for chunk in client.generate("Hello", max_tokens=8, temperature=0.0, stop=["\n"]):
            token_ids: tuple[int, ...] = chunk.token_ids
            ids.extend(token_ids)
            reason: FinishReason | None = chunk.finish_reason
            if reason is FinishReason.STOP and isinstance(chunk.stop, str):
                print(chunk.stop.upper())
        result: GenerateResult = client.complete(token_ids=ids, params=GenerateParams(n=2), seed=3)
        usage: Usage | None = result.usage
        if usage is not None:
            total: int = usage.total_tokens
            print(total)
        try:
            vectors: list[list[float]] = client.embed(["a", [1, 2]]).vectors
            print(vectors)
        except OverloadedError as exc:
            request_id: str | None = exc.request_id
            print(exc.code.name, exc.message, request_id)
        schema = JsonSchema({"type": "object", "properties": {"n": {"type": "integer"}}})
        wire: str = schema.text
        constraint: StructuredOutput = schema
        json_text: str = client.complete("Hi", max_tokens=16, structured_output=constraint).text
        first_choice: str = Choice(["a", "b"]).options[0]
        tags = StructuralTag([Tag("<f>", {"type": "object"}, "</f>")], triggers=["<"])
        params = GenerateParams(structured_output=tags)
        if client.complete("Hi", params=params).finish_reason is FinishReason.CONSTRAINT_DEAD_END:
            print(wire, json_text, first_choice)
        healthy: bool = client.health() is HealthStatus.SERVING
        running: int = client.load().num_running_requests
        print(healthy, running, client.model_info().vocab_size, client.detokenize(ids))
        return ids


async def async_main(target: str) -> str:
    async with AsyncEngineClient(target) as client:
        text = ""
        async with client.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=4) as stream:
            async for chunk in stream:
                typed: GenerateChunk = chunk
                text += typed.text
            rid: str = stream.request_id
            aborted: tuple[str, ...] = await client.abort(rid)
            print(aborted)
        try:
            offsets = (await client.tokenize("abc", return_offsets=True)).offsets
            if offsets is not None:
                start, end = offsets[0]
                print(start + end)
        except EngineError as exc:
            print(exc)
        return text


if __name__ == "__main__":
    sync_main("127.0.0.1:50051")
    asyncio.run(async_main("127.0.0.1:50051"))
