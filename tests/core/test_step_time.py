"""The online step-time model: recovers known coefficients, adapts when they change."""

import random

import pytest

from iterserve.core.step_time import COEFFICIENTS, StepTimeModel

TRUE = dict(c0=0.007, c_tok=0.0, c_seq=0.0027, c_kv=4.1e-6, c_prefill_tok=0.002)


def seconds(c, tokens, seqs, kv, prefill):
    return (c["c0"] + c["c_tok"] * tokens + c["c_seq"] * seqs + c["c_kv"] * kv
            + c["c_prefill_tok"] * prefill)


def shapes(rng, n):
    """Batch shapes as an engine makes them: decodes, sometimes a prefill chunk."""
    for _ in range(n):
        d = rng.randint(0, 32)
        p = rng.choice([0, 0, 0, 16, 64, 128])
        if d == 0 and p == 0:
            d = 1
        kv = sum(rng.randint(16, 1024) for _ in range(d)) + p
        yield d + p, d + (1 if p else 0), kv, p


def mean_rel_error(model, truth, rng, n=300):
    errs = [abs(model.predict(*s) / seconds(truth, *s) - 1) for s in shapes(rng, n)]
    return sum(errs) / len(errs)


def test_recovers_known_coefficients_from_a_wrong_seed():
    rng = random.Random(1)
    seed = {k: v * 3 + 1e-4 for k, v in TRUE.items()}        # 3x off, c_tok seeded nonzero
    m = StepTimeModel(seed)
    assert mean_rel_error(m, TRUE, random.Random(2)) > 1.0
    for s in shapes(rng, 1500):
        m.observe(*s, seconds(TRUE, *s))
    assert mean_rel_error(m, TRUE, random.Random(2)) < 0.03
    assert m.coefficients["c0"] == pytest.approx(TRUE["c0"], rel=0.25)
    assert all(v >= 0 for v in m.coefficients.values())


def test_noise_and_outliers_do_not_throw_it_off():
    rng = random.Random(3)
    m = StepTimeModel(TRUE)
    for i, s in enumerate(shapes(rng, 1500)):
        y = seconds(TRUE, *s) * (1 + rng.gauss(0, 0.05))
        if i % 97 == 0:
            y *= 20                                            # a GC pause
        m.observe(*s, y)
    assert mean_rel_error(m, TRUE, random.Random(4)) < 0.06


def test_adapts_when_the_machine_slows_down():
    rng = random.Random(5)
    m = StepTimeModel(TRUE)
    for s in shapes(rng, 500):
        m.observe(*s, seconds(TRUE, *s))
    slow = {k: 2 * v for k, v in TRUE.items()}                 # e.g. another job took a core
    assert mean_rel_error(m, slow, random.Random(6)) > 0.4
    for s in shapes(rng, 600):
        m.observe(*s, seconds(slow, *s))
    assert mean_rel_error(m, slow, random.Random(6)) < 0.1


def test_unexcited_directions_stay_at_the_seed():
    """Decode-only steps never separate c_tok from c_seq: the split stays near the seed and
    the prediction of decode steps is right."""
    rng = random.Random(7)
    m = StepTimeModel(TRUE)
    for _ in range(3000):
        d = rng.randint(1, 32)
        kv = d * rng.randint(16, 1024)
        m.observe(d, d, kv, 0, seconds(TRUE, d, d, kv, 0))
    c = m.coefficients
    assert c["c_prefill_tok"] == pytest.approx(TRUE["c_prefill_tok"], rel=0.05)
    assert m.predict(8, 8, 2048, 0) == pytest.approx(seconds(TRUE, 8, 8, 2048, 0), rel=0.02)


def test_bad_input():
    with pytest.raises(ValueError):
        StepTimeModel([1.0, 2.0])
    with pytest.raises(ValueError):
        StepTimeModel({"c0": -1.0})
    m = StepTimeModel(TRUE)
    before = m.coefficients
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        m.observe(1, 1, 10, 0, bad)
    m.observe(0, 0, 0, 0, 0.5)                                 # an empty step
    assert m.coefficients == before and m.num_observed == 0
    assert set(before) == set(COEFFICIENTS)


def decode_only(rng, n):
    for _ in range(n):
        d = rng.randint(1, 32)
        kv = d * rng.randint(16, 1024)
        yield d, d, kv, 0


def test_decode_only_traffic_on_a_slower_machine_scales_the_prefill_cost_too():
    """The seed's prefill cost is not kept when only decodes run: the machine is 2x slower
    than the seed everywhere, the decode steps show it, and the unexcited prefill term
    follows the measured speed (the bug: it stayed at the seed's value)."""
    rng = random.Random(11)
    m = StepTimeModel(TRUE)
    slow = {k: 2 * v for k, v in TRUE.items()}
    for s in decode_only(rng, 800):
        m.observe(*s, seconds(slow, *s))
    assert m.speed == pytest.approx(2.0, rel=0.05)
    assert m.coefficients["c_prefill_tok"] == pytest.approx(slow["c_prefill_tok"], rel=0.1)
    shape = (40, 9, 9 * 300 + 32, 32)               # 8 decodes and a 32-token chunk
    assert m.predict(*shape) == pytest.approx(seconds(slow, *shape), rel=0.1)


def test_a_measured_prefill_cost_keeps_its_ratio_through_decode_only_stretches():
    """Prefill measured 3x cheaper than the seed says; then only decodes, on a machine that
    slows down 1.5x: the prefill term keeps the measured ratio and scales with the machine
    (it neither snaps back to the seed nor stays at its old absolute value)."""
    rng = random.Random(12)
    m = StepTimeModel(TRUE)
    real = dict(TRUE, c_prefill_tok=TRUE["c_prefill_tok"] / 3)
    for s in shapes(rng, 600):
        m.observe(*s, seconds(real, *s))
    assert m.coefficients["c_prefill_tok"] == pytest.approx(real["c_prefill_tok"], rel=0.1)
    assert m.confidence()["c_prefill_tok"] >= 4.0
    slower = {k: 1.5 * v for k, v in real.items()}
    for s in decode_only(rng, 1500):                # 15 memories: the prefill data is gone
        m.observe(*s, seconds(slower, *s))
    assert m.confidence()["c_prefill_tok"] < 1.0
    assert m.coefficients["c_prefill_tok"] == pytest.approx(slower["c_prefill_tok"], rel=0.15)
    assert m.predict(8, 8, 2048, 0) == pytest.approx(seconds(slower, 8, 8, 2048, 0), rel=0.03)


# --- the attention term: chunks deep into a prompt cost more ------------------------------

ATTN = dict(TRUE, c_attn=9e-7)


def attn_seconds(c, tokens, seqs, kv, prefill, pairs):
    return seconds(c, tokens, seqs, kv, prefill) + c["c_attn"] * pairs


def chunked_shapes(rng, n):
    """Decodes plus, often, a prefill chunk at some depth into a long prompt."""
    for _ in range(n):
        d = rng.randint(1, 16)
        kv = sum(rng.randint(16, 1024) for _ in range(d))
        if rng.random() < 0.5:
            c, start = rng.choice([64, 128]), rng.choice([0, 256, 768, 1536])
            yield d + c, d + 1, kv + start + c, c, c * (start + c)
        else:
            yield d, d, kv, 0, 0


def test_learns_the_attention_term_from_a_seed_without_it():
    """Seeded from a fit of before (five coefficients, no c_attn): chunks deep into long
    prompts teach it the term, and a 128-token chunk at context 1,500 is then predicted."""
    m = StepTimeModel([TRUE[k] for k in COEFFICIENTS[:5]])      # an old 5-term seed
    assert m.coefficients["c_attn"] == 0.0
    deep = (16 + 128, 17, 16 * 257 + 1628, 128, 128 * 1628)
    assert m.predict(*deep) < 0.8 * attn_seconds(ATTN, *deep)
    rng = random.Random(21)
    for t, s, kv, p, a in chunked_shapes(rng, 1500):
        m.observe(t, s, kv, p, attn_seconds(ATTN, t, s, kv, p, a), a)
    assert m.coefficients["c_attn"] == pytest.approx(ATTN["c_attn"], rel=0.15)
    # the machine did not change speed: the new term explains the chunk steps, the speed
    # fit must not try to (it ran away to its clip when the term was held near 0)
    assert m.speed == pytest.approx(1.0, rel=0.05)
    assert m.predict(*deep) == pytest.approx(attn_seconds(ATTN, *deep), rel=0.03)
    assert m.predict(8, 8, 2048, 0) == pytest.approx(seconds(ATTN, 8, 8, 2048, 0), rel=0.03)


def test_steps_given_without_attention_pairs_still_fit_as_before():
    m = StepTimeModel(ATTN)
    rng = random.Random(22)
    m.observe_many((*s, seconds(TRUE, *s)) for s in shapes(rng, 400))
    assert mean_rel_error(m, TRUE, random.Random(23)) < 0.05


JOINT_LIN = dict(c0=0.028, c_tok=1.4e-3, c_seq=2.8e-3, c_kv=1.4e-6)
JOINT_CORR = ((1, -0.01), (8, -0.015), (16, -0.02), (128, -0.06), (512, -0.25))
JOINT_SHAPES = ((1, 1, 300, 0, 0), (8, 8, 8 * 300, 0, 0), (128, 1, 128, 128, 128 * 128),
                (40, 8, 7 * 300 + 33, 33, 33 * 33), (2000, 1, 2000, 2000, 2000 * 2001 // 2))


def test_a_cost_model_with_token_corrections_seeds_with_them():
    """Seeded from a v3 fit, the online model predicts what the lab's cost model says for
    every shape (the same corrections, the same clamp, proportional beyond the last knot):
    the SLO policy and the lab's simulated steps are the same function at the seed."""
    from iterserve.core.cost_model import CostModel

    joint = CostModel(**JOINT_LIN, token_corrections=JOINT_CORR)
    raw = CostModel(**JOINT_LIN)
    m = StepTimeModel.from_cost_model(joint)
    assert m.correction_level == 1.0
    for shape in JOINT_SHAPES:
        want = joint.runner_time(*shape)
        if shape[0] > 1:
            assert abs(raw.runner_time(*shape) / want - 1) > 0.05
        assert m.predict(*shape) == pytest.approx(want, rel=1e-9)
    clamped = CostModel(c0=0.01, token_corrections=((1, -1.0), (2, -1.0)))
    assert StepTimeModel.from_cost_model(clamped).predict(1, 1, 0) == pytest.approx(0.001)
    plain = StepTimeModel.from_cost_model(CostModel(c0=0.02, c_tok=1e-3))
    assert plain.coefficients["c0"] == pytest.approx(0.02) and plain.correction_level == 0.0


def joint_seconds(cost, level, speed, shape):
    """A runner whose corrections are `level` x the seed's, on a machine `speed` x slower."""
    lin = sum(getattr(cost, k) * f for k, f in zip(COEFFICIENTS, (1, *shape)))
    return speed * max(lin + level * cost.correction(shape[0]), 0.1 * lin)


def joint_shapes(rng, n):
    for _ in range(n):
        d = rng.randint(1, 24)
        kv = sum(rng.randint(16, 1024) for _ in range(d))
        r = rng.random()
        if r < 0.3:
            p = rng.choice([16, 64, 128, 256])
            yield d + p, d + 1, kv + p, p, p * (p + 1) // 2
        elif r < 0.35:
            p = rng.choice([512, 1024, 2000])
            yield p, 1, p, p, p * (p + 1) // 2
        else:
            yield d, d, kv, 0, 0


@pytest.mark.parametrize("level, speed", [(1.0, 1.0), (1.0, 2.0), (0.4, 1.0), (1.6, 1.3)])
def test_the_corrections_level_is_refitted_online_and_follows_the_machine(level, speed):
    """The corrections' shape comes from the seed; their level is learned with the linear
    terms: on a machine twice as slow they double with the rest, and a runner whose
    corrections are weaker or stronger than the fit's is matched too."""
    from iterserve.core.cost_model import CostModel

    joint = CostModel(**JOINT_LIN, token_corrections=JOINT_CORR)
    m = StepTimeModel.from_cost_model(joint)
    rng = random.Random(31)
    for shape in joint_shapes(rng, 2000):
        m.observe(*shape[:4], joint_seconds(joint, level, speed, shape), shape[4])
    errs = [abs(m.predict(*s) / joint_seconds(joint, level, speed, s) - 1)
            for s in joint_shapes(random.Random(32), 300)]
    assert sum(errs) / len(errs) < 0.03
    for shape in JOINT_SHAPES:
        assert m.predict(*shape) == pytest.approx(joint_seconds(joint, level, speed, shape),
                                                  rel=0.08)


def test_bad_corrections_are_refused():
    with pytest.raises(ValueError, match="corrections"):
        StepTimeModel(TRUE, corrections=((8, 0.0), (4, 0.1)))
    with pytest.raises(ValueError, match="corrections"):
        StepTimeModel(TRUE, corrections=((1, float("nan")),))


def test_attention_pairs_are_causal_so_a_prompt_costs_what_its_chunks_add_up_to():
    from iterserve.core.step_time import attention_pairs
    assert attention_pairs(0, 1) == 1 and attention_pairs(0, 4) == 10
    assert attention_pairs(100, 4) == 4 * 100 + 10
    for size in (1, 7, 64, 128, 500):
        chunks = sum(attention_pairs(s, min(size, 1000 - s)) for s in range(0, 1000, size))
        assert chunks == attention_pairs(0, 1000)
