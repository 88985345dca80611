"""Engine test fixtures: one tiny random llama (with the tiny trained tokenizer) per session."""

from __future__ import annotations

import pytest

from fixtures.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    # Shared with tests/server through the session's base temp dir: building the model
    # imports transformers, which is the slow part.
    base = tmp_path_factory.getbasetemp() / "iterserve-shared-tiny-llama"
    existing = [p for p in base.glob("*") if (p / "config.json").exists()] if base.exists() else []
    if existing:
        return existing[0]
    base.mkdir(parents=True, exist_ok=True)
    return make_tiny_model_dir(base)
