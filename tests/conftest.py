"""Fixtures shared by every test package."""
from __future__ import annotations

from pathlib import Path

import pytest

from connector import tinymodel


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The "tiny" random-weight Llama (4 layers, 2 KV heads x 64), built once per session."""
    return tinymodel.build_named(tmp_path_factory.mktemp("models") / "tiny", "tiny")


@pytest.fixture(scope="session")
def tiny2_model(tmp_path_factory) -> Path:
    """A second KV geometry ("tiny2": 6 layers, 4 KV heads x 32), built once per session."""
    return tinymodel.build_named(tmp_path_factory.mktemp("models") / "tiny2", "tiny2")
