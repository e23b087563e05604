"""LoRA adapters through engine.v1 on real servers (issue 41): Generate's adapter field, the admin RPCs and
every bad input (clear statuses, nothing loaded, the server serving as before)."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from apiutil import CALL_TIMEOUT_S, completion_ids, greedy_request
from engine_proto.engine.v1 import adapters_pb2, generate_pb2, info_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from engine_server.models.tiny import default_model_dir
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from lora_testutil import AdapterSpec, build_adapter, peft_greedy, peft_model
from serverproc import RunningServer, start_server

A = AdapterSpec("a", 4, ("q_proj", "v_proj"), lora_alpha=8, seed=11)
B = AdapterSpec("b", 8, ("gate_proj", "up_proj", "down_proj"), lora_alpha=16, use_rslora=True, seed=12)
PROMPT = [17, 230, 5, 99, 4, 801, 66, 12, 7]
API_KEY, ADMIN_KEY = "api-key-1", "admin-key-1"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the adapter directory: a, b and broken ones; a directory outside it with a copy of a)."""
    root, outside = tmp_path_factory.mktemp("adapter-dir"), tmp_path_factory.mktemp("outside")
    model_dir = default_model_dir()
    for spec in (A, B):
        build_adapter(model_dir, root, spec)
    shutil.copytree(root / "a", outside / "a")
    shutil.copytree(root / "a", root / "rank-32")
    config = json.loads((root / "rank-32" / "adapter_config.json").read_text())
    (root / "rank-32" / "adapter_config.json").write_text(json.dumps({**config, "r": 32}))
    shutil.copytree(root / "a", root / "corrupt")
    (root / "corrupt" / "adapter_model.safetensors").write_bytes(b"\x07" * 100)
    (root / "link-out").symlink_to(outside / "a")
    return root, outside


@pytest.fixture(scope="module")
def admin_server(dirs: tuple[Path, Path]) -> Iterator[RunningServer]:
    root, _ = dirs
    with start_server("--adapter", f"a={root / 'a'}", "--adapter-dir", str(root), "--enable-adapter-admin",
                      "--max-adapters", "2", "--in-process-engine") as running:
        yield running


@pytest.fixture
async def stub(admin_server: RunningServer) -> AsyncIterator[EngineServiceStub]:
    channel = Channel("127.0.0.1", admin_server.port)
    yield EngineServiceStub(channel)
    channel.close()


async def _generate(stub: EngineServiceStub, adapter: str = "") -> list[int]:
    request = greedy_request(PROMPT, max_tokens=10, ignore_eos=True)
    request.adapter = adapter
    return completion_ids(await stub.Generate(request, timeout=CALL_TIMEOUT_S))


async def _names(stub: EngineServiceStub) -> list[str]:
    listed = await stub.ListAdapters(adapters_pb2.ListAdaptersRequest(), timeout=CALL_TIMEOUT_S)
    return [info.name for info in listed.adapters]


async def test_generate_with_an_adapter_gives_peft_tokens_and_info_lists_it(
        stub: EngineServiceStub, dirs: tuple[Path, Path]) -> None:
    want = peft_greedy(peft_model(default_model_dir(), dirs[0] / "a"), PROMPT, 10)
    assert await _generate(stub, "a") == want
    assert await _generate(stub) != want
    model = await stub.GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S)
    assert [(x.name, x.rank, x.lora_alpha, list(x.target_modules)) for x in model.adapters] == [
        ("a", 4, 8.0, ["q_proj", "v_proj"])]
    server = await stub.GetServerInfo(info_pb2.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S)
    assert list(server.adapters) == ["a"]
    assert (server.limits.max_adapters, server.limits.max_lora_rank) == (2, 16)


async def test_unknown_adapter_is_invalid_argument(stub: EngineServiceStub) -> None:
    with pytest.raises(GRPCError) as caught:
        await _generate(stub, "nope")
    assert caught.value.status is Status.INVALID_ARGUMENT
    assert "adapter" in (caught.value.message or "")


async def test_load_use_list_and_unload(stub: EngineServiceStub) -> None:
    loaded = await stub.LoadAdapter(adapters_pb2.LoadAdapterRequest(name="b", path="b"),
                                    timeout=CALL_TIMEOUT_S)
    assert (loaded.adapter.rank, loaded.adapter.use_rslora) == (8, True)
    with_b = await _generate(stub, "b")
    assert with_b != await _generate(stub)
    assert await _names(stub) == ["a", "b"]
    await stub.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name="b"), timeout=CALL_TIMEOUT_S)
    assert await _names(stub) == ["a"]
    with pytest.raises(GRPCError) as unknown:
        await stub.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name="b"), timeout=CALL_TIMEOUT_S)
    assert unknown.value.status is Status.NOT_FOUND
    with pytest.raises(GRPCError) as exists:
        await stub.LoadAdapter(adapters_pb2.LoadAdapterRequest(name="a", path="b"), timeout=CALL_TIMEOUT_S)
    assert exists.value.status is Status.ALREADY_EXISTS


@pytest.mark.parametrize(("path", "message"), [
    ("../{outside}/a", "outside the server's adapter directory"),
    ("{outside_abs}/a", "outside the server's adapter directory"),
    ("link-out", "outside the server's adapter directory"),
    ("missing", "does not exist"),
    ("rank-32", "max_lora_rank is 16"),
    ("corrupt", "not a readable safetensors"),
])
async def test_bad_loads_are_refused_and_change_nothing(stub: EngineServiceStub, dirs: tuple[Path, Path],
                                                        path: str, message: str) -> None:
    before = await _generate(stub, "a")
    outside = dirs[1]
    request = adapters_pb2.LoadAdapterRequest(
        name="bad", path=path.format(outside=outside.name, outside_abs=outside))
    with pytest.raises(GRPCError) as caught:
        await stub.LoadAdapter(request, timeout=CALL_TIMEOUT_S)
    assert caught.value.status is Status.INVALID_ARGUMENT
    assert message in (caught.value.message or "")
    assert await _names(stub) == ["a"]
    assert await _generate(stub, "a") == before


async def test_admin_calls_are_off_by_default(channel: Channel) -> None:
    """The shared server was started without --enable-adapter-admin."""
    stub = EngineServiceStub(channel)
    with pytest.raises(GRPCError) as caught:
        await stub.LoadAdapter(adapters_pb2.LoadAdapterRequest(name="x", path="x"), timeout=CALL_TIMEOUT_S)
    assert caught.value.status is Status.PERMISSION_DENIED
    request = greedy_request(PROMPT, max_tokens=2)
    request.adapter = "a"
    with pytest.raises(GRPCError) as generate:
        await stub.Generate(request, timeout=CALL_TIMEOUT_S)
    assert generate.value.status is Status.INVALID_ARGUMENT


async def test_admin_key_guards_the_admin_calls_where_api_keys_are_used(dirs: tuple[Path, Path]) -> None:
    root, _ = dirs
    with start_server("--api-key", API_KEY, "--adapter-dir", str(root), "--enable-adapter-admin",
                      "--admin-key", ADMIN_KEY, "--in-process-engine") as server:
        channel = Channel("127.0.0.1", server.port)
        stub = EngineServiceStub(channel)
        request = adapters_pb2.LoadAdapterRequest(name="a", path="a")
        bearer = ("authorization", f"Bearer {API_KEY}")
        try:
            for metadata, status in (([bearer], Status.PERMISSION_DENIED),
                                     ([bearer, ("x-admin-key", "wrong")], Status.PERMISSION_DENIED),
                                     ([("x-admin-key", ADMIN_KEY)], Status.UNAUTHENTICATED)):
                with pytest.raises(GRPCError) as caught:
                    await stub.LoadAdapter(request, metadata=metadata, timeout=CALL_TIMEOUT_S)
                assert caught.value.status is status
            listed = await stub.ListAdapters(adapters_pb2.ListAdaptersRequest(), timeout=CALL_TIMEOUT_S,
                                             metadata=[bearer, ("x-admin-key", ADMIN_KEY)])
            assert list(listed.adapters) == []
            loaded = await stub.LoadAdapter(request, metadata=[bearer, ("x-admin-key", ADMIN_KEY)],
                                            timeout=CALL_TIMEOUT_S)
            assert loaded.adapter.name == "a"
            generate = greedy_request(PROMPT, max_tokens=3)
            generate.adapter = "a"
            responses: list[generate_pb2.GenerateResponse] = await stub.Generate(
                generate, metadata=[bearer], timeout=CALL_TIMEOUT_S)
            assert len(completion_ids(responses)) == 3
        finally:
            channel.close()
