"""Attempts, the retry policy both clients share: which failures are retried, how often, by the deadline."""

from __future__ import annotations

import pytest
from engine_client import ConnectionOptions, RetryPolicy, StatusCode
from engine_client._retry import Attempts
from engine_client.errors import error_from_status

NO_JITTER = RetryPolicy(max_attempts=3, initial_backoff=0.1, max_backoff=1.0, jitter=0.0)
UNAVAILABLE = error_from_status(StatusCode.UNAVAILABLE, "down")


def test_unavailable_is_retried_with_backoff_until_the_attempts_are_spent() -> None:
    attempts = Attempts(ConnectionOptions(retry=NO_JITTER), None)
    assert attempts.timeout() is None
    assert attempts.backoff(UNAVAILABLE) == pytest.approx(0.1)
    assert attempts.backoff(UNAVAILABLE) == pytest.approx(0.2)
    assert attempts.backoff(UNAVAILABLE) is None


def test_other_errors_and_unrepeatable_calls_are_final_and_spend_no_retry() -> None:
    attempts = Attempts(ConnectionOptions(retry=NO_JITTER), None)
    assert attempts.backoff(error_from_status(StatusCode.INTERNAL, "bug")) is None
    assert attempts.backoff(UNAVAILABLE, is_repeatable=False) is None
    assert attempts.backoff(UNAVAILABLE) == pytest.approx(0.1)  # the first delay is still there


def test_no_retry_when_the_sleep_would_outlast_the_deadline() -> None:
    slow = RetryPolicy(max_attempts=3, initial_backoff=30.0, max_backoff=30.0, jitter=0.0)
    attempts = Attempts(ConnectionOptions(retry=slow), 5.0)
    timeout = attempts.timeout()
    assert timeout is not None
    assert 0 < timeout <= 5.0
    assert attempts.backoff(UNAVAILABLE) is None
