"""bf16 dot-product kernels for BF16 / F16 weights (kernels/bf16dot.c, AVX-512 BF16).

The kernels round each activation row to bf16 once per call and sum exact bf16 x bf16
products in float32, so they must equal x.bfloat16() @ W in float64 to float32 summation
error, on the decode and the panel kernel, every tile remainder, strided x and a column
offset in the output; the `auto` activation mode must route BF16 weights through them in
`qgemm` (decode steps, the fused decode layers) and `gemm` (prefill), `float` must keep the
exact float32 path; and a tiny random bf16 HF checkpoint must match HF transformers within
bf16-activation tolerances in auto, and tightly in float. Skipped on CPUs without avx512bf16
(the float path, tested elsewhere, is what runs there).
"""

from __future__ import annotations

import pytest
import torch

from iterserve.model import kernels

BF16, F16 = 30, 1


def _has_bf16() -> bool:
    return kernels.available() and kernels.bf16_isa() == "avx512bf16"


pytestmark = pytest.mark.skipif(not _has_bf16(), reason="needs the native kernels and an "
                                "avx512bf16 CPU")


def _weight(t: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16 if t == BF16 else torch.float16)
    return w, w.view(torch.uint8).view(n, 2 * k)


def _reference(x: torch.Tensor, w: torch.Tensor):
    """x rounded to bf16 (and an F16 weight rounded to bf16) times W in float64, and the
    scale sum |x_j w_j| per output, for the float32 summation bound."""
    xb = x.bfloat16().double()
    wd = w.bfloat16().double()
    return xb @ wd.t(), xb.abs() @ wd.abs().t()


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref, scale = _reference(x, w)
    k = x.shape[1]
    # float32 sums of k exact products: |err| <= ~k * 2^-24 * sum|x w|; well inside that
    bound = 4 * k * 2.0 ** -24 * scale + 1e-30
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max().item()} vs bound {bound.min().item()}"


@pytest.mark.parametrize("t", [BF16, F16])
@pytest.mark.parametrize("path", ["stream", "decode", "panel", "auto"])
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (1, 9, 96), (2, 7, 64), (3, 33, 256),
                                   (5, 100, 128), (8, 64, 2048), (9, 31, 64), (13, 70, 320),
                                   (16, 40, 64), (31, 65, 256), (40, 33, 1024),
                                   (100, 96, 96)])
def test_kernels_equal_bf16_rounded_activations_times_the_weight(t, path, m, n, k):
    w, wu = _weight(t, n, k, seed=m * 7 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    out = torch.full((m, n), float("nan"))
    kernels.qgemm_bf16(t, wu, k, x, out, 0, path)
    _check(out, x, w)


@pytest.mark.parametrize("path", ["stream", "decode", "panel"])
def test_strided_activations_and_a_column_offset(path):
    m, n, k = 11, 45, 192
    w, wu = _weight(BF16, n, k)
    big = torch.randn(m, k + 40)
    x = big[:, 8:8 + k]                                   # row stride k + 40
    out = torch.full((m, n + 20), -7.0)
    kernels.qgemm_bf16(BF16, wu, k, x, out, 13, path)
    _check(out[:, 13:13 + n], x.contiguous(), w)
    assert (out[:, :13] == -7).all() and (out[:, 13 + n:] == -7).all()


@pytest.mark.parametrize("t", [BF16, F16])
@pytest.mark.parametrize("m", range(1, 34))
def test_streamed_decode_every_row_count_and_group_tail(t, m):
    """Every row count of the streamed kernel's tiles (1..8 per tile, 1..5 tiles, unequal
    tiles) with a weight-row count that leaves a tail after the groups of 8/6/4/3 (n = 77 =
    3 * 24 + 5), at K = 96 (3 steps of 32)."""
    n, k = 77, 96
    w, wu = _weight(t, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 100))
    out = torch.full((m, n), float("nan"))
    kernels.qgemm_bf16(t, wu, k, x, out, 0, "stream")
    _check(out, x, w)


@pytest.mark.parametrize("m", [1, 3, 8, 12])
def test_streamed_decode_two_threads_split_the_weight_rows(m):
    """n >= 64 * threads: both threads run (split on whole groups of 24 rows); the sums must
    not depend on the thread count (each output is one thread's)."""
    n, k = 301, 2048
    w, wu = _weight(BF16, n, k)
    x = torch.randn(m, k)
    outs = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.full((m, n), float("nan"))
            kernels.qgemm_bf16(BF16, wu, k, x, out, 0, "stream")
            outs.append(out)
    finally:
        torch.set_num_threads(old)
    _check(outs[1], x, w)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("m", [1, 8, 20, 64])
def test_auto_mode_routes_bf16_weights_through_the_bf16_kernels(m):
    n, k = 50, 256
    w, wu = _weight(BF16, n, k)
    x = torch.randn(m, k)
    direct = torch.empty(m, n)
    kernels.qgemm_bf16(BF16, wu, k, x, direct, 0)
    exact = x.double() @ w.double().t()
    for fn in (kernels.qgemm, kernels.gemm):
        kernels.set_activations("auto")
        assert kernels.bf16_takes(BF16, m) and kernels.bf16_takes(F16, m) == (m >= 16)
        auto = torch.empty(m, n)
        fn(BF16, wu, k, x, auto)
        assert torch.equal(auto, direct)                   # the same kernel, bit for bit
        kernels.set_activations("float")
        assert not kernels.bf16_takes(BF16, m)
        flt = torch.empty(m, n)
        fn(BF16, wu, k, x, flt)
        torch.testing.assert_close(flt.double(), exact, rtol=1e-5, atol=1e-4)   # exact path
        assert not torch.equal(flt, auto)                  # activations were rounded in auto
        # bf16-appropriate tolerance against the float path: 2^-8 of sum |x w| per output
        scale = x.abs().double() @ w.abs().double().t()
        assert ((auto.double() - exact).abs() <= 2.0 ** -8 * scale).all()


def test_int8_mode_and_switching_the_kernels_off_keep_bf16_on_the_float_path():
    m, n, k = 4, 40, 128
    w, wu = _weight(BF16, n, k)
    x = torch.randn(m, k)
    flt = torch.empty(m, n)
    kernels.set_activations("float")
    kernels.qgemm(BF16, wu, k, x, flt)
    kernels.set_activations("int8")
    assert not kernels.bf16_takes(BF16, m)
    got = torch.empty(m, n)
    kernels.qgemm(BF16, wu, k, x, got)
    assert torch.equal(got, flt)
    kernels.set_activations("auto")
    try:
        assert kernels.bf16_isa("none") == "none"
        assert not kernels.bf16_takes(BF16, m)
        kernels.qgemm(BF16, wu, k, x, got)
        assert torch.equal(got, flt)
        with pytest.raises(ValueError, match="not available"):
            kernels.qgemm_bf16(BF16, wu, k, x, got)
    finally:
        assert kernels.bf16_isa() == "avx512bf16"
        kernels.set_activations("float")


def test_bad_arguments_raise_before_the_kernel_runs():
    w, wu = _weight(BF16, 8, 64)
    x, out = torch.randn(2, 64), torch.empty(2, 8)
    with pytest.raises(ValueError, match="no bf16"):
        kernels.qgemm_bf16(2, wu, 64, x, out)
    with pytest.raises(ValueError):
        kernels.qgemm_bf16(BF16, wu, 64, torch.randn(2, 32), out)
    with pytest.raises(ValueError):
        kernels.qgemm_bf16(BF16, wu, 64, x, torch.empty(2, 4))
    with pytest.raises(KeyError):
        kernels.qgemm_bf16(BF16, wu, 64, x, out, 0, "sideways")


# --- a tiny random bf16 HF checkpoint against HF transformers -------------------------------

@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    from safetensors.torch import load_file, save_file
    from fixtures.tiny_models import make_tiny_model_dir
    d = make_tiny_model_dir(tmp_path_factory.mktemp("bf16"), hidden_size=128,
                            intermediate_size=256)
    st = load_file(str(d / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in st.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    return d


def _steps(d, mode: str, decode_steps: int = 4):
    """Prefill two prompts then decode: the last-position logits of every step, with the
    activation mode set as the engine sets it when a model loads."""
    from fixtures.tiny_models import Blocks, advance, chunk, greedy, request, step
    from iterserve.model.loader import load_model
    from iterserve.model.runner import ModelRunner
    seen = []

    def sampler(logits, requests):
        seen.append(logits.clone())
        return greedy(logits, requests)

    lm = load_model(str(d))
    assert kernels.set_activations(mode) == mode
    runner = ModelRunner(lm, num_blocks=64, block_size=4, sampler=sampler)
    assert runner.fused_decode
    blocks = Blocks(64, 4)
    reqs = [request("a", [5, 17, 99, 300, 42, 7, 8, 9, 10, 11, 12] * 4), request("b", [3, 4])]
    out = step(*(chunk(blocks, r) for r in reqs))
    advance(out, runner.execute(out))
    for s in range(decode_steps):
        out = step(*(chunk(blocks, r, 1) for r in reqs), step_no=1 + s)
        advance(out, runner.execute(out))
    return seen, [r.output_token_ids for r in reqs], reqs


def test_bf16_checkpoint_matches_hf_transformers_in_auto_and_float(bf16_dir):
    from fixtures.tiny_models import load_hf_reference
    ref = load_hf_reference(bf16_dir)                 # bf16 weights widened, float32 math
    got = {}
    for mode in ("float", "auto"):
        seen, tokens, reqs = _steps(bf16_dir, mode)
        got[mode] = (seen, tokens)
    kernels.set_activations("float")
    # HF on each sequence's tokens as the float run generated them
    seen_f, tokens_f = got["float"]
    prompts = [[5, 17, 99, 300, 42, 7, 8, 9, 10, 11, 12] * 4, [3, 4]]
    with torch.no_grad():
        for i, (p, toks) in enumerate(zip(prompts, tokens_f)):
            seq = p + toks
            hf = ref(torch.tensor([seq])).logits[0].float()
            for s, logits in enumerate(seen_f):
                pos = len(p) - 1 + s
                torch.testing.assert_close(logits[i], hf[pos], atol=2e-4, rtol=1e-4)
                la = got["auto"][0][s][i]
                if got["auto"][1][i][:s] == toks[:s]:        # same context so far
                    # bf16 activations: ~2^-9 relative per GEMM input, a few layers deep
                    err = (la - hf[pos]).abs().max().item()
                    assert err <= 0.03 * hf[pos].abs().max().item(), (s, i, err)
                    assert err > 0                           # the bf16 kernels did run
