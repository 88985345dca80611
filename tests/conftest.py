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


@pytest.fixture(autouse=True)
def _float_kernel_activations():
    """Every test starts with float activations in the native decode GEMM (the C library's
    own default). The mode is process-wide and an engine built by an earlier test sets it
    (`--kernel-activations auto` means int8, kernels/qdot8.c); kernel tests that compare with
    a float GEMM at fp32 tolerance must not inherit that. Engines built inside a test apply
    their own knob."""
    kernels = sys.modules.get("iterserve.model.kernels")
    if kernels is not None and kernels._library.cache_info().currsize and kernels.available():
        kernels.set_activations("float")
    yield
