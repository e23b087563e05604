"""Pure unit tests of engine-client: the status -> exception table, options, params (no network)."""

from __future__ import annotations

import dataclasses
import pickle
from typing import cast

import pytest
from engine_client import (
    AuthenticationError,
    ConnectionOptions,
    DeadlineExceededError,
    GenerateOptions,
    GenerateParams,
    InternalError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    RequestCancelledError,
    RetryPolicy,
    StatusCode,
    TLSConfig,
    UnavailableError,
    UnimplementedError,
    _convert,
)
from engine_client.errors import EngineError, error_from_status
from engine_client.options import with_overrides
from engine_client.types import EngineState, FinishReason, ModelTask
from engine_proto.engine.v1 import info_pb2

EXPECTED = {
    StatusCode.CANCELLED: RequestCancelledError,
    StatusCode.UNKNOWN: InternalError,
    StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    StatusCode.NOT_FOUND: NotFoundError,
    StatusCode.ALREADY_EXISTS: InvalidRequestError,
    StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    StatusCode.FAILED_PRECONDITION: InvalidRequestError,
    StatusCode.ABORTED: UnavailableError,
    StatusCode.OUT_OF_RANGE: InvalidRequestError,
    StatusCode.UNIMPLEMENTED: UnimplementedError,
    StatusCode.INTERNAL: InternalError,
    StatusCode.UNAVAILABLE: UnavailableError,
    StatusCode.DATA_LOSS: InternalError,
    StatusCode.UNAUTHENTICATED: AuthenticationError,
}


@pytest.mark.parametrize("code", list(EXPECTED))
def test_every_status_maps_to_one_class(code: StatusCode) -> None:
    error = error_from_status(int(code), "msg", request_id="r1")
    assert type(error) is EXPECTED[code]
    assert error.code is code
    assert error.message == "msg"
    assert error.request_id == "r1"
    assert isinstance(error, EngineError)


def test_unknown_code_and_empty_message() -> None:
    error = error_from_status(99, None)
    assert isinstance(error, InternalError)
    assert error.code is StatusCode.UNKNOWN
    assert error.message == "unknown"
    assert isinstance(PermissionDeniedError(StatusCode.PERMISSION_DENIED, "x"), AuthenticationError)


def test_errors_pickle() -> None:
    error = error_from_status(8, "busy", request_id="r")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is OverloadedError
    assert (copy.code, copy.message, copy.request_id) == (error.code, error.message, error.request_id)


def test_generate_options_mirror_params() -> None:
    assert set(GenerateOptions.__annotations__) == {f.name for f in dataclasses.fields(GenerateParams)}


def test_params_normalise_and_validate() -> None:
    params = GenerateParams(stop="\n", stop_token_ids=[3], logit_bias={1: 2.0})
    assert params.stop == ("\n",)
    assert params.stop_token_ids == (3,)
    with pytest.raises(ValueError, match="max_tokens"):
        GenerateParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        GenerateParams(temperature=float("nan"))
    with pytest.raises(TypeError, match="top_k"):
        GenerateParams(top_k=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed"):
        GenerateParams(seed=-1)
    with pytest.raises(TypeError, match="stop"):
        GenerateParams(stop=[1])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("target", "address"),
    [("localhost:50051", ("localhost", 50051)), ("[::1]:9", ("::1", 9)), ("unix:/tmp/s.sock", "/tmp/s.sock"),
     ("unix:///tmp/s.sock", "/tmp/s.sock")],
)
def test_targets(target: str, address: object) -> None:
    assert ConnectionOptions(target).address() == address


@pytest.mark.parametrize("target", ["localhost", ":80", "host:0", "host:99999", "unix:", "host:x"])
def test_bad_targets(target: str) -> None:
    with pytest.raises(ValueError, match="target"):
        ConnectionOptions(target)


def test_option_validation() -> None:
    with pytest.raises(ValueError, match="cert_file and key_file"):
        TLSConfig(cert_file="c.pem")
    with pytest.raises(ValueError, match="api_key"):
        ConnectionOptions(api_key="a\nb")
    with pytest.raises(ValueError, match="timeout"):
        ConnectionOptions(timeout=0)
    with pytest.raises(ValueError, match="ConnectionOptions"):
        with_overrides(ConnectionOptions(), api_key="k", tls=None, timeout=None)
    assert ConnectionOptions(api_key="k").metadata() == (("authorization", "Bearer k"),)
    assert "s3cr3t" not in repr(ConnectionOptions(api_key="s3cr3t"))


def test_retry_delays_grow_and_are_bounded() -> None:
    delays = list(RetryPolicy(max_attempts=6, initial_backoff=0.1, max_backoff=0.4, jitter=0.0).delays())
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.4, 0.4])
    assert list(RetryPolicy(max_attempts=1).delays()) == []
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)


@pytest.mark.parametrize("number", [-2, -1, 99])
def test_enum_numbers_no_version_names_convert_to_unknown(number: int) -> None:
    # (open enums: a server may send any int32; negative numbers used to index the tables from their end)
    assert _convert.finish_reason(number) is FinishReason.UNKNOWN
    assert _convert.engine_state(number) is EngineState.UNSPECIFIED
    response = info_pb2.GetModelInfoResponse(task=cast(info_pb2.ModelTask.ValueType, number))
    assert _convert.model_info(response).task is ModelTask.UNSPECIFIED


def test_load_carries_requests_and_completions_apart() -> None:
    message = info_pb2.Load(num_running_requests=1, num_waiting_requests=2, num_running_completions=8)
    load = _convert.load(message, info_pb2.ENGINE_STATE_SERVING)
    assert (load.num_running_requests, load.num_waiting_requests, load.num_running_completions) == (1, 2, 8)
    assert load.state is EngineState.SERVING
