"""Fixtures shared by the kernel tests of this folder: force one instruction set of the float
GEMM kernels (`isa`: qgemm.c / prefill.c, kernels.gemm_isa) or of the int8 kernels (`isa8`:
qdot8.c / prefill8.c, kernels.int8_isa) for a test, parametrized indirectly
(`@pytest.mark.parametrize("isa", [...], indirect=True)`), and restore the best one after."""

from __future__ import annotations

import pytest

from iterserve.model import kernels


@pytest.fixture
def isa(request):
    got = kernels.gemm_isa(request.param)
    assert got == request.param
    yield got
    kernels.gemm_isa(None)


@pytest.fixture
def isa8(request):
    if request.param == "avx512vnni" and not {"avx512f", "avx512bw", "avx512vl",
                                              "avx512vnni"} <= kernels.features():
        pytest.skip("the CPU has no AVX-512 VNNI")
    got = kernels.int8_isa(request.param)
    assert got == request.param
    yield got
    kernels.int8_isa()
