"""The generated Python code imports under `engine_proto` in every flavour and exposes the whole service."""

from __future__ import annotations

import importlib

import pytest

RPCS = [
    "Generate", "Embed", "Tokenize", "Detokenize", "Abort", "GetModelInfo", "GetServerInfo", "GetLoad",
    "FlushCache", "SubscribeCacheEvents", "LoadAdapter", "UnloadAdapter", "ListAdapters",
]
FILES = ["engine_service", "generate", "embed", "tokenize", "info", "cache", "adapters"]


@pytest.mark.parametrize("suffix", ["_pb2", "_pb2_grpc", "_grpc"])
@pytest.mark.parametrize("name", FILES)
def test_modules_import(name: str, suffix: str) -> None:
    importlib.import_module(f"engine_proto.engine.v1.{name}{suffix}")


def test_no_bare_engine_package_is_claimed() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("engine.v1.generate_pb2")


def test_service_descriptor_lists_every_rpc() -> None:
    from engine_proto.engine.v1 import engine_service_pb2

    service = engine_service_pb2.DESCRIPTOR.services_by_name["EngineService"]
    assert service.full_name == "engine.v1.EngineService"
    assert [method.name for method in service.methods] == RPCS
    assert service.methods_by_name["Generate"].server_streaming
    assert service.methods_by_name["SubscribeCacheEvents"].server_streaming


def test_stubs_of_every_flavour_expose_every_rpc() -> None:
    from engine_proto.betterproto.engine import v1 as bp
    from engine_proto.engine.v1 import engine_service_grpc, engine_service_pb2_grpc

    grpclib_handlers = engine_service_grpc.EngineServiceBase.__abstractmethods__
    assert set(grpclib_handlers) == set(RPCS)
    for rpc in RPCS:
        assert hasattr(engine_service_pb2_grpc.EngineServiceServicer, rpc)
        assert hasattr(engine_service_grpc.EngineServiceStub(channel=None), rpc)  # type: ignore[arg-type]
    snake = {
        "GetModelInfo": "get_model_info", "GetServerInfo": "get_server_info", "GetLoad": "get_load",
        "FlushCache": "flush_cache", "SubscribeCacheEvents": "subscribe_cache_events",
        "LoadAdapter": "load_adapter", "UnloadAdapter": "unload_adapter", "ListAdapters": "list_adapters",
    }
    for rpc in RPCS:
        assert hasattr(bp.EngineServiceStub, snake.get(rpc, rpc.lower()))
        assert hasattr(bp.EngineServiceSyncStub, snake.get(rpc, rpc.lower()))


def test_optional_fields_distinguish_unset_from_zero() -> None:
    from engine_proto.engine.v1 import generate_pb2

    params = generate_pb2.SamplingParams()
    assert not params.HasField("temperature")
    params.temperature = 0.0
    assert params.HasField("temperature")  # 0 means greedy, not "use the default"
    parsed = generate_pb2.SamplingParams.FromString(params.SerializeToString())
    assert parsed.HasField("temperature")
    assert parsed.temperature == 0.0
