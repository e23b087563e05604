"""SecurityConfig / H2Policy validation: every bad value is a one-line ValueError naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from engine_server.api.security import H2Policy, SecurityConfig
from sec_certs import CertFiles


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_receive_message_size": 0}, "max_receive_message_size"),
        ({"max_receive_message_size": 1 << 31}, "max_receive_message_size"),
        ({"request_receive_timeout_s": 0.0}, "request_receive_timeout_s"),
        ({"keepalive_time_s": -1.0}, "keepalive_time_s"),
        ({"keepalive_timeout_s": float("nan")}, "keepalive_timeout_s"),
        ({"api_key": ""}, "api_key"),
        ({"api_key": "has space"}, "api_key"),
        ({"api_key": "caf\u00e9"}, "api_key"),
        ({"auth_exempt_services": ("/grpc.health.v1.Health/Check",)}, "auth_exempt_services"),
        ({"tls_cert_file": "/nonexistent.crt", "tls_key_file": "/nonexistent.key"}, "no such file"),
    ],
)
def test_invalid_security_config(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SecurityConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_concurrent_streams": 0}, "max_concurrent_streams"),
        ({"max_ping_strikes": -1}, "max_ping_strikes"),
        ({"min_ping_interval_s": 0.0}, "min_ping_interval_s"),
        ({"reset_burst": 0}, "reset_burst"),
        ({"reset_rate_per_s": float("inf")}, "reset_rate_per_s"),
        ({"control_frame_burst": 0}, "control_frame_burst"),
        ({"control_frame_rate_per_s": -1.0}, "control_frame_rate_per_s"),
        ({"max_connection_idle_s": 0.0}, "max_connection_idle_s"),
    ],
)
def test_invalid_h2_policy(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        H2Policy(**kwargs)


def test_tls_files_must_come_together(cert_files: CertFiles) -> None:
    with pytest.raises(ValueError, match="together"):
        SecurityConfig(tls_cert_file=cert_files.server_cert)
    with pytest.raises(ValueError, match="mTLS"):
        SecurityConfig(tls_client_ca_file=cert_files.ca)
    config = SecurityConfig(
        tls_cert_file=cert_files.server_cert,
        tls_key_file=cert_files.server_key,
        tls_client_ca_file=cert_files.ca,
    )
    assert config.is_tls
    assert config.is_mtls
    assert config.server_ssl_context() is not None
    assert SecurityConfig().server_ssl_context() is None


def test_api_key_is_not_in_repr() -> None:
    assert "s3cret" not in repr(SecurityConfig(api_key="s3cret"))


def test_grpclib_configuration() -> None:
    config = SecurityConfig(keepalive_time_s=30.0, keepalive_timeout_s=5.0).grpclib_configuration()
    assert (config._keepalive_time, config._keepalive_timeout) == (30.0, 5.0)
    assert config._http2_min_sent_ping_interval_without_data == 30.0
    assert (
        SecurityConfig(keepalive_time_s=None).grpclib_configuration().__for_server__()._keepalive_time is None
    )
