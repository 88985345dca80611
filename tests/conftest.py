"""Shared test setup. `tests/` is put on sys.path so tests import helpers as `fixtures.*`."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# Keep tests reproducible and within the 2 cores CI has.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """One tiny random llama (with the tiny trained tokenizer) per test session, shared by
    the engine, server and bench tests: building it imports transformers, the slow part."""
    from fixtures.tiny_models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("shared-tiny-llama"))
