"""Shared fixtures: the test models, built once and cached (chunkstore.testing.models)."""

from __future__ import annotations

from pathlib import Path

import pytest

from chunkstore.testing.models import model_dir


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return model_dir("tiny")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return model_dir("smollm2")
