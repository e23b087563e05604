"""Shared fixtures for every test directory. Keep it small: directory-specific fixtures live beside their
tests.

NOTE: this file also puts tests/ on sys.path (pytest's rootdir conftest), so helpers such as `serverproc`
import as top-level modules.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The embedded tiny random-weight model (built once, cached)."""
    from engine_server.models.tiny import default_model_dir

    return default_model_dir()
