"""A sequence's logits do not depend on how its tokens are scheduled (issue 28), on the model
runner with hand-made steps, for every model form with a native path.

Hypothesis draws a schedule for one target sequence (a 40-token prompt, then three decoded
tokens): its prompt chunks of any size, companions in the same steps (prompts of other
lengths, a prompt sharing its first blocks, a sibling with the same prompt as n > 1 makes,
decodes), a prefix-cache hit (its first blocks reused from a companion that computed them),
a preemption by recompute (the whole sequence again, chunked anew) or by swap (its blocks
copied out and back into other blocks), block size 4 or 16. The target's four logits rows
must equal, bit for bit, those of the same sequence run alone: the prompt in one chunk, then
one decode per token.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fixtures.invariance import FORMS, form_param, invariant_now, make_form
from fixtures.tiny_models import Blocks, request, step
from iterserve.model import kernels
from iterserve.model.loader import load_model
from iterserve.model.runner import ModelRunner
from iterserve.core.scheduler_output import SchedulerOutput

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")

PROMPT, EXTRA = 40, 3            # the target: 40 prompt tokens, then 3 fed back one at a time
NUM_BLOCKS = 160


@pytest.fixture(scope="module", params=[form_param(f) for f in FORMS])
def model(request, tmp_path_factory):
    """The form's model, with the batch-invariant kernels on for the forms that need them
    (fixtures/invariance.knobs)."""
    m = load_model(str(make_form(request.param, tmp_path_factory.mktemp(request.param))))
    m.batch_invariant = not invariant_now(request.param)
    return m


def _configure(model, mode: str) -> None:
    kernels.configure(kernels.KernelConfig(activations=mode,
                                           batch_invariant=model.batch_invariant))


def _target_tokens(vocab: int) -> list[int]:
    rng = random.Random(28)
    return [rng.randrange(3, vocab) for _ in range(PROMPT + EXTRA)]


class _Seq:
    """A request with the tokens it will have: its prompt, then `extra` fed back in turn."""

    def __init__(self, rid: str, tokens: list[int], prompt_len: int) -> None:
        self.req = request(rid, tokens[:prompt_len])
        self.extra = list(tokens[prompt_len:])

    def chunk(self, blocks: Blocks, n: int):
        from fixtures.tiny_models import chunk
        return chunk(blocks, self.req, n)

    @property
    def left(self) -> int:                     # tokens not yet computed
        return self.req.num_tokens - self.req.num_computed_tokens

    def after(self, sampled: bool) -> None:
        if sampled and self.extra:
            self.req.append_output_token(self.extra.pop(0), 0.0)


def _run(runner: ModelRunner, chunks, swap_out=(), swap_in=()) -> dict[str, torch.Tensor]:
    out = step(*chunks)
    out.blocks_to_swap_out, out.blocks_to_swap_in = list(swap_out), list(swap_in)
    logits = runner.compute_logits(out)
    rows = {}
    i = 0
    for c in chunks:
        c.request.num_computed_tokens = c.start + c.num_tokens
        if c.sample:
            rows[c.request.request_id] = logits[i].clone()
            i += 1
    return rows


def _alone(model, mode: str, bs: int) -> list[torch.Tensor]:
    _configure(model, mode)
    runner = ModelRunner(model, num_blocks=NUM_BLOCKS, block_size=bs)
    blocks = Blocks(NUM_BLOCKS, bs, seed=1)
    t = _Seq("t", _target_tokens(model.config.vocab_size), PROMPT)
    got = []
    while True:
        rows = _run(runner, [t.chunk(blocks, t.left)])
        got.append(rows["t"])
        if not t.extra:
            return got
        t.after(True)


_reference: dict = {}


@pytest.mark.parametrize("mode", ["auto", "float"])
# no shrinking: a failure prints its draws, and shrinking a schedule took minutes
@settings(max_examples=10, deadline=None, derandomize=True,
          phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_logits_of_a_sequence_do_not_depend_on_its_schedule(model, mode, data):
    bs = data.draw(st.sampled_from([4, 16]), label="block_size")
    key = (id(model), mode, bs)
    if key not in _reference:
        _reference[key] = _alone(model, mode, bs)
    want = _reference[key]
    _configure(model, mode)
    V = model.config.vocab_size
    tokens = _target_tokens(V)
    runner = ModelRunner(model, num_blocks=NUM_BLOCKS, block_size=bs, num_swap_blocks=16)
    blocks = Blocks(NUM_BLOCKS, bs, seed=data.draw(st.integers(0, 99), label="block_order"))
    rng = random.Random(data.draw(st.integers(0, 2 ** 16), label="token_seed"))

    # companions: other prompts, one sharing the target's first blocks, a sibling
    companions = []
    for i in range(data.draw(st.integers(0, 4), label="companions")):
        n = data.draw(st.integers(1, 60), label="companion_len")
        toks = [rng.randrange(3, V) for _ in range(n + 4)]
        companions.append(_Seq(f"c{i}", toks, n))
    # whole blocks, short of the prompt (a full hit still computes the last token)
    shared = data.draw(st.integers(0, (PROMPT - 1) // bs), label="shared_blocks") * bs
    if shared:
        toks = tokens[:shared] + [rng.randrange(3, V) for _ in range(9)]
        companions.append(_Seq("prefix", toks, shared + 5))
    if data.draw(st.booleans(), label="sibling"):
        companions.append(_Seq("sibling", tokens, PROMPT))
    t = _Seq("t", tokens, PROMPT)
    prefix_hit = shared and data.draw(st.booleans(), label="prefix_hit")
    if prefix_hit:                                  # the companion computes the prefix first
        p = next(c for c in companions if c.req.request_id == "prefix")
        _run(runner, [p.chunk(blocks, shared)])
        blocks.tables["t"] = list(blocks.tables["prefix"][:shared // bs])
        t.req.num_computed_tokens = shared
    preempt = data.draw(st.sampled_from(["none", "recompute", "swap"]), label="preempt")
    preempt_at = data.draw(st.integers(1, PROMPT + EXTRA - 1), label="preempt_at")

    got = []
    for _ in range(200):
        if len(got) == len(want):
            break
        computed = t.req.num_computed_tokens
        if preempt != "none" and computed >= preempt_at:
            if preempt == "recompute":
                t.req.num_computed_tokens = 0
                blocks.tables["t"] = []
                runner.requests.pop("t", None)
            else:                                   # out to the host pool, back elsewhere
                old = blocks.tables["t"]
                host = list(range(len(old)))
                _run(runner, [], swap_out=list(zip(old, host)))
                new = [blocks.free.pop() for _ in old]
                _run(runner, [], swap_in=list(zip(host, new)))
                blocks.tables["t"] = new
            preempt = "none"
        chunks = []
        if t.left:
            n = t.left if t.left == 1 else data.draw(st.integers(1, t.left), label="chunk")
            chunks.append(t.chunk(blocks, n))
        for c in companions:
            if c.left and data.draw(st.booleans(), label="companion_runs"):
                chunks.append(c.chunk(blocks, data.draw(st.integers(1, c.left),
                                                        label="companion_chunk")))
        if data.draw(st.booleans(), label="shuffle"):
            random.Random(len(got)).shuffle(chunks)
        rows = _run(runner, chunks)
        for c in companions:
            c.after(c.req.request_id in rows)
        if "t" in rows:
            got.append(rows["t"])
            t.after(True)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), (f"logits row {i} differ from the sequence alone by up to "
                                   f"{(g - w).abs().max().item():.3g}")


def test_the_runner_sends_bf16_pool_decodes_to_the_prefill_kernel(tiny_model_dir):
    """bf16 KV pools: no native decode kernel, so every sequence goes to the prefill kernel
    (decodes as one-token chunks) rather than the padded SDPA path."""
    lm = load_model(str(tiny_model_dir))
    lm.config.kv_cache_dtype = torch.bfloat16
    runner = ModelRunner(lm, num_blocks=8, block_size=4)
    assert runner.decode_kernel is None and runner.prefill_kernel
    seen = []
    real = kernels.PrefillChunks.run

    def spy(self, *a, **k):
        seen.append(self.qlens.tolist())
        return real(self, *a, **k)

    import unittest.mock
    blocks = Blocks(8, 4)
    a, b = request("a", [5, 6, 7]), request("b", [8, 9])
    with unittest.mock.patch.object(kernels.PrefillChunks, "run", spy):
        from fixtures.tiny_models import chunk
        out: SchedulerOutput = step(chunk(blocks, a, 2), chunk(blocks, b, 1))
        runner.compute_logits(out)
    assert seen and sorted(seen[0]) == [1, 2]
