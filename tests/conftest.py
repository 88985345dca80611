"""Shared test setup. `tests/` is put on sys.path so tests import shared code as `fixtures.*`."""

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



def _kernels_loaded():
    kernels = sys.modules.get("iterserve.model.kernels")
    if kernels is not None and kernels._library.cache_info().currsize and kernels.available():
        return kernels
    return None


@pytest.fixture(scope="module", autouse=True)
def _module_starts_with_float_activations():
    """Each test module starts (and ends) with float activations in the native decode GEMM,
    the C library's own default. The mode is process-wide and an engine sets it when it loads
    a model (`--kernel-activations auto`: int8 where measured faster, kernels/qdot8.c), so
    kernel tests comparing with a float GEMM at fp32 tolerance must not inherit it from an
    engine an earlier module built. Engines a module builds apply their own knob; rank and
    replica processes apply it too, so they agree with in-process engines."""
    k = _kernels_loaded()
    if k is not None:
        k.set_activations("float")
    yield
    k = _kernels_loaded()
    if k is not None:
        k.set_activations("float")


@pytest.fixture(autouse=True)
def _test_restores_activations():
    """A test that changes the mode (or builds an engine that does) leaves the module's mode
    as it found it, for the module-scoped engines of the tests after it."""
    k = _kernels_loaded()
    before = k.activations() if k is not None else None
    yield
    k = _kernels_loaded()
    if k is not None:
        k.set_activations(before or "float")
