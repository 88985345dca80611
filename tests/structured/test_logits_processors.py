"""logit_bias, allowed_token_ids, bad_words, min_tokens on random logits, row by row against
a plain per-row reference."""

import pytest
import torch

from iterserve.model import logits_processors as lp

V = 97


def logits(n=4, seed=0):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed))


def test_logit_bias_rows_and_clamp():
    x = logits()
    ref = x.clone()
    biases = [{3: 5.0, 10: -2.5}, None, {}, {96: 100.0}]
    lp.apply_logit_bias(x, biases)
    ref[0, 3] += 5.0
    ref[0, 10] -= 2.5
    ref[3, 96] += 100.0
    assert torch.equal(x, ref)
    # +100 makes a token the argmax, -100 removes it, as OpenAI documents
    y = logits(seed=1)
    lp.apply_logit_bias(y, [{7: 100.0}, {int(y[1].argmax()): -100.0}, None, None])
    assert int(y[0].argmax()) == 7
    assert int(y[1].argmax()) != int(logits(seed=1)[1].argmax())


def test_validate_logit_bias():
    assert lp.validate_logit_bias({"5": 300, "6": -1e9, 7: 1.5}, V) == {5: 100.0, 6: -100.0, 7: 1.5}
    assert lp.validate_logit_bias(None, V) is None
    for bad in ({"x": 1}, {"97": 1}, {"-1": 1}, {"3": "big"}, {"3": float("nan")},
                {"3": float("inf")}, {"2.5": 1}):
        with pytest.raises(lp.LogitsParamError) as e:
            lp.validate_logit_bias(bad, V)
        assert e.value.param == "logit_bias"


def test_allowed_token_ids():
    x = logits()
    ref = x.clone()
    lp.apply_allowed_token_ids(x, [[1, 5, 9], None, [0], []])
    assert torch.isfinite(x[0]).nonzero().flatten().tolist() == [1, 5, 9]
    assert torch.equal(x[0, [1, 5, 9]], ref[0, [1, 5, 9]])
    assert torch.equal(x[1], ref[1]) and torch.equal(x[3], ref[3])
    assert torch.isfinite(x[2]).nonzero().flatten().tolist() == [0]
    y = logits(2)
    lp.apply_allowed_token_ids(y, [[4], [4, 8]])           # every row: the direct path
    assert y[0].argmax() == 4 and set(torch.isfinite(y[1]).nonzero().flatten().tolist()) == {4, 8}
    with pytest.raises(lp.LogitsParamError):
        lp.validate_token_ids([], V, "allowed_token_ids")
    with pytest.raises(lp.LogitsParamError) as e:
        lp.validate_token_ids([1, 200], V, "allowed_token_ids")
    assert e.value.param == "allowed_token_ids"


def test_bad_words_block_the_completing_token():
    x = logits()
    ref = x.clone()
    words = [[20], [30, 31], [40, 41, 42]]
    outputs = [[1, 2], [5, 30], [40, 41], [41, 40]]
    lp.apply_bad_words(x, [words, words, words, None], outputs)
    blocked = {(r, c) for r in range(4) for c in range(V) if x[r, c] == float("-inf")}
    assert blocked == {(0, 20), (1, 20), (1, 31), (2, 20), (2, 42)}
    assert torch.equal(x[3], ref[3])


def test_bad_words_tokenised_at_start_and_mid_text(tiny_model_dir):
    from iterserve.model.tokenizer import Tokenizer
    tok = Tokenizer.from_hf_dir(tiny_model_dir)
    seqs = lp.bad_words_token_ids(tok, ["fox", "quick brown"])
    assert tok.encode("fox", add_special_tokens=False) in seqs
    assert tok.encode(" fox", add_special_tokens=False) in seqs
    assert tok.encode("quick brown", add_special_tokens=False) in seqs
    with pytest.raises(lp.LogitsParamError):
        lp.bad_words_token_ids(tok, [""])
    # driven through the function: " fox" cannot be produced after any output
    fox = tok.encode(" fox", add_special_tokens=False)
    x = torch.zeros(1, tok.vocab_size)
    x[0, fox[0]] = 10.0
    out = tok.encode("The quick brown", add_special_tokens=False) + fox[:-1]
    lp.apply_bad_words(x, [seqs], [out])
    assert x[0, fox[-1]] == float("-inf")


def test_min_tokens():
    x = logits()
    ref = x.clone()
    stops = [[2, 3], [2], [2, 50], [2]]
    lp.apply_min_tokens(x, [5, 5, None, 1], [4, 5, 0, 0], stops)
    assert x[0, 2] == x[0, 3] == float("-inf")
    assert torch.equal(x[1], ref[1]) and torch.equal(x[2], ref[2])
    assert x[3, 2] == float("-inf") and torch.isfinite(x[3, :2]).all()


def test_apply_all_in_order_and_reports_use():
    x = logits()
    assert not lp.apply_logits_processors(x, logit_bias=[None] * 4, min_tokens=[0] * 4)
    used = lp.apply_logits_processors(
        x, allowed_token_ids=[[1, 2, 3], None, None, None],
        logit_bias=[{1: 50.0, 4: 100.0}, None, None, None],   # 4 is not allowed: stays -inf
        bad_words=[None, [[7]], None, None], min_tokens=[None, None, 3, None],
        output_token_ids=[[], [], [0], []], stop_token_ids=[[2]] * 4)
    assert used
    assert x[0].argmax() == 1 and x[0, 4] == float("-inf")
    assert x[1, 7] == float("-inf") and x[2, 2] == float("-inf")


def test_large_batch_is_vectorised_and_matches_reference():
    g = torch.Generator().manual_seed(3)
    n, vocab = 64, 49152
    x = torch.randn(n, vocab, generator=g)
    ref = x.clone()
    biases = [{int(t): float(b) for t, b in zip(torch.randint(0, vocab, (20,), generator=g),
                                                 torch.randn(20, generator=g))}
              if i % 2 else None for i in range(n)]
    lp.apply_logit_bias(x, biases)
    for i, b in enumerate(biases):
        for t, v in (b or {}).items():
            ref[i, t] += v
    assert torch.allclose(x, ref)
