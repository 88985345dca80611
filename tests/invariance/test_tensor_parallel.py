"""Tensor parallel under the default kernels (issue 28): TP = 2 within 0.02 of one process in
first-token logprobs, and bitwise invariant to the batch within TP = 2 (a request alone and
the same request among others that force preemption). The ranks sum o/down's partial
products in rank order (parallel.ordered_all_reduce), so with batch-invariant kernels every
rank's arithmetic is the batch's business no more than one process's is."""

from __future__ import annotations

import random

import pytest

from fixtures.invariance import knobs, make_form
from iterserve import LLM, SamplingParams
from iterserve.model import kernels

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="needs the native kernels"),
              pytest.mark.slow]


@pytest.fixture(scope="module", params=["gguf-F32", "gguf-Q4_0", "gguf-Q4_K"])
def engines(request, tmp_path_factory):
    """(form, a TP = 1 engine with the defaults, `tp2(invariant)`: the TP = 2 engine with the
    defaults, or with the settings under which the form is batch invariant (the defaults
    again or `--batch-invariant`)). One tensor-parallel group runs in a process at a time, so
    asking for the other settings shuts the last TP = 2 engine down."""
    form = request.param
    path = str(make_form(form, tmp_path_factory.mktemp(form)))
    kw = dict(num_kv_blocks=24, block_size=16, max_model_len=256, max_num_batched_tokens=32,
              max_num_seqs=8)
    one = LLM(path, **kw)
    held: dict = {}

    def tp2(invariant: bool = False):
        linear = knobs(form) if invariant else {}
        key = tuple(sorted(linear.items()))
        if key not in held:
            for old in held.values():
                old.engine.shutdown()
            held.clear()
            held[key] = LLM(path, tensor_parallel_size=2, **kw, **linear)
        return held[key]

    yield form, one, tp2
    for old in held.values():
        old.engine.shutdown()


def _prompts(n: int, seed: int, lo: int = 5, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _result(out):
    o = out.outputs[0]
    return tuple(o.token_ids), tuple((lp.token_id, lp.logprob, tuple(lp.top_logprobs))
                                     for lp in o.logprobs)


def test_first_token_logprobs_of_tp2_are_within_0_02_of_one_process(engines):
    _, one, tp2 = engines
    two = tp2()
    prompts = _prompts(6, 0)
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)
    worst = 0.0
    for a, b in zip(one.generate(prompts, sp, use_tqdm=False),
                    two.generate(prompts, sp, use_tqdm=False)):
        la = dict(a.outputs[0].logprobs[0].top_logprobs)
        lb = dict(b.outputs[0].logprobs[0].top_logprobs)
        common = set(la) & set(lb)
        assert len(common) >= 15
        worst = max(worst, max(abs(la[t] - lb[t]) for t in common))
    assert worst < 0.02


def test_tp2_answers_a_request_the_same_alone_and_in_a_preempting_batch(engines):
    two = engines[2](invariant=True)
    target = _prompts(1, 28, 40, 40)[0]
    sp = SamplingParams(max_tokens=24, temperature=0.0, logprobs=5, ignore_eos=True)
    alone = _result(two.generate([target], sp, use_tqdm=False)[0])
    others = _prompts(7, 5, 20, 60)
    outs = two.generate(others[:3] + [target] + others[3:],
                        [SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)] * 3
                        + [sp] + [SamplingParams(max_tokens=60, temperature=0.0,
                                                 ignore_eos=True)] * 4, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert _result(outs[3]) == alone


def test_the_ranks_partial_sums_are_added_in_rank_order_whatever_the_size():
    """Three ranks (gloo's ring would order each chunk's sum from another rank, by size):
    row 0 of the sum is ((y0 + y1) + y2) on every rank and for every row count."""
    import multiprocessing as mp
    import socket

    import torch
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    from fixtures.invariance import ordered_sum_rank
    procs = [ctx.Process(target=ordered_sum_rank, args=(r, 3, port, q)) for r in range(3)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    ys = [torch.randn(64, 96, generator=torch.Generator().manual_seed(r))[0] for r in range(3)]
    want = ((ys[0] + ys[1]) + ys[2]).tolist()
    for rank in range(3):
        assert all(row == want for row in results[rank])
