"""End to end: structured outputs through the smg gateway (PyPI `smg`) in front of two of our workers.

The tiny model has random weights: only the constraint can make its output valid, so every output here is
checked against what was asked for (JSON that parses, a schema it validates against, tool calls whose name and
arguments fit the tool). What smg 1.13 sends the worker (no --tool-call-parser):
- response_format json_object: json_schema '{"type":"object"}';
- response_format json_schema: json_schema, the schema;
- tools with tool_choice "required": json_schema, an array of {name, parameters} (one anyOf branch per tool);
  smg parses the JSON array into tool_calls;
- tools with a named tool_choice: json_schema, that tool's parameters; the call's name is the named tool;
- its `regex` and `ebnf` extensions: regex and grammar.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from serverproc import RunningServer, start_servers
from smgproc import RunningGateway, sse_events, start_gateway

MODEL = "tiny"
HTTP_TIMEOUT_S = 120.0  # two cores shared by two workers, the gateway and other tests
# NOTE: json_object, and the array smg asks for with tool_choice "required" (no maxItems; its items allow more
# keys), do not bound the output: a prompt whose greedy output closes soon, not one the model never ends
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 256  # far more than the outputs below need (greedy: 10 to 30 tokens here)

COLOR_SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["color", "count", "note"],
    "additionalProperties": False,
}


def tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI function tool whose arguments are all required, and nothing else."""
    parameters = {"type": "object", "properties": properties, "required": list(properties),
                  "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": parameters}}


DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
TOOLS = [
    tool("get_weather", "The weather in a city.", {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                   "unit": {"type": "string", "enum": ["C", "F"]}}),
    tool("add", "Adds two digits.", {"a": DIGIT, "b": DIGIT}),
]
PARAMETERS = {entry["function"]["name"]: entry["function"]["parameters"] for entry in TOOLS}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workers() -> Iterator[list[RunningServer]]:
    # As test_smg_e2e: one worker with its engine core in a process of its own (the constraint crosses the
    # process boundary), one with it on a thread; round robin sends each case's two requests to both.
    servers = start_servers(
        2, "--served-model-name", MODEL, "--max-num-seqs", "8", "--drain-timeout", "1",
        per_server_args=[(), ("--in-process-engine",)], env={"OMP_NUM_THREADS": "1"},
    )
    try:
        yield servers
    finally:
        for server in servers:
            if server.process.poll() is None:
                server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def gateway(workers: list[RunningServer]) -> Iterator[RunningGateway]:
    with start_gateway([w.target for w in workers]) as gw:
        gw.wait_for_workers(2)
        yield gw


def chat(gateway: RunningGateway, **body: Any) -> dict[str, Any]:
    """Choice 0 of a chat completion as one message (a stream's deltas put together): content, tool_calls
    (each with its name and whole arguments) and finish_reason."""
    request = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, **body}
    url = f"{gateway.url}/v1/chat/completions"
    if not request.get("stream"):
        reply = httpx.post(url, json=request, timeout=HTTP_TIMEOUT_S)
        assert reply.status_code == 200, reply.text
        choice: dict[str, Any] = reply.json()["choices"][0]
        message = choice["message"]
        return {"content": message.get("content"), "tool_calls": message.get("tool_calls") or [],
                "finish_reason": choice["finish_reason"]}
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish_reason = None
    with httpx.stream("POST", url, json=request, timeout=HTTP_TIMEOUT_S) as reply:
        assert reply.status_code == 200, reply.read()
        for event in sse_events(reply):
            assert "error" not in event, event
            for choice in event["choices"]:
                delta = choice["delta"]
                content.append(delta.get("content") or "")
                for piece in delta.get("tool_calls") or []:
                    call = calls.setdefault(piece["index"], {"function": {"name": "", "arguments": ""}})
                    function = piece.get("function") or {}
                    call["function"]["name"] += function.get("name") or ""
                    call["function"]["arguments"] += function.get("arguments") or ""
                finish_reason = choice.get("finish_reason") or finish_reason
    return {"content": "".join(content), "tool_calls": [calls[i] for i in sorted(calls)],
            "finish_reason": finish_reason}


def check_tool_calls(message: dict[str, Any], *, names: set[str]) -> None:
    """At least one call, each to one of `names`, with arguments that fit that tool's parameters."""
    assert message["finish_reason"] == "tool_calls"
    assert message["tool_calls"]
    for call in message["tool_calls"]:
        name = call["function"]["name"]
        assert name in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_json_object(gateway: RunningGateway, stream: bool) -> None:
    for _ in range(2):  # round robin: both workers
        message = chat(gateway, stream=stream, response_format={"type": "json_object"})
        assert message["finish_reason"] == "stop"
        assert isinstance(json.loads(message["content"]), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema(gateway: RunningGateway, stream: bool) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "paint", "schema": COLOR_SCHEMA}}
    for _ in range(2):
        message = chat(gateway, stream=stream, response_format=response_format)
        assert message["finish_reason"] == "stop"
        jsonschema.validate(json.loads(message["content"]), COLOR_SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required(gateway: RunningGateway, stream: bool) -> None:
    for _ in range(2):
        message = chat(gateway, stream=stream, tools=TOOLS, tool_choice="required")
        check_tool_calls(message, names=set(PARAMETERS))


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_named_function(gateway: RunningGateway, stream: bool) -> None:
    for name in ("add", "get_weather"):  # not only the first tool
        tool_choice = {"type": "function", "function": {"name": name}}
        message = chat(gateway, stream=stream, tools=TOOLS, tool_choice=tool_choice)
        check_tool_calls(message, names={name})


@pytest.mark.parametrize(("extension", "pattern"), [
    ({"regex": "(yes|no)-[0-9]{2}"}, r"(yes|no)-[0-9]{2}"),
    ({"ebnf": 'root ::= answer "-" [0-9]\nanswer ::= "yes" | "no"\n'}, r"(yes|no)-[0-9]"),  # GBNF
    ({"ebnf": 'start: ("yes" | "no") "-" /[0-9]/\n'}, r"(yes|no)-[0-9]"),  # Lark
], ids=["regex", "gbnf", "lark"])
def test_regex_and_grammars(gateway: RunningGateway, extension: dict[str, str], pattern: str) -> None:
    """smg's own extensions reach vLLM's regex and grammar fields."""
    for stream in (False, True):
        message = chat(gateway, stream=stream, **extension)
        assert message["finish_reason"] == "stop"
        assert re.fullmatch(pattern, message["content"]), message["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_that_does_not_compile_is_http_400_naming_the_field(
    gateway: RunningGateway, stream: bool
) -> None:
    """Refused where the engine compiles it, after admission, yet before any header: HTTP 400 streamed too."""
    response_format = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectx"}}}
    request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": stream,
               "response_format": response_format}
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=request, timeout=HTTP_TIMEOUT_S)
    assert reply.status_code == 400, reply.text
    assert "json_schema: " in reply.json()["error"]["message"]
