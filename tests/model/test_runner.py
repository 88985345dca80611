"""ModelRunner behaviour beyond numerics: swap round trips, the default Sampler, sizes, bad input."""

from __future__ import annotations

import pytest
import torch

from fixtures.tiny_models import Blocks, advance, chunk, greedy, make_tiny_model_dir, request, step
from iterserve.core.scheduler_output import SchedulerOutput
from iterserve.errors import KVCacheError, ModelLoadError, UnsupportedModelError
from iterserve.model.loader import load_model
from iterserve.model.runner import ModelRunner


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir))


def test_swap_out_and_in_round_trip_preserves_kv(loaded):
    runner = ModelRunner(loaded, num_blocks=16, block_size=4, num_swap_blocks=8, sampler=greedy)
    blocks = Blocks(16, 4)
    r = request("r", list(range(3, 13)))            # 10 tokens -> 3 blocks
    out = step(chunk(blocks, r))
    advance(out, runner.execute(out))
    table = blocks.tables["r"]
    kv = runner.kv_cache
    before = [(kv.k[i][table].clone(), kv.v[i][table].clone()) for i in range(len(kv.k))]
    runner.execute(SchedulerOutput(step=1, blocks_to_swap_out=[(b, h) for h, b in enumerate(table)]))
    for i in range(len(kv.k)):                      # the device blocks get reused by someone else
        kv.k[i].zero_()
        kv.v[i].zero_()
    new_table = [b for b in range(16) if b not in table][:3]
    runner.execute(SchedulerOutput(step=2, blocks_to_swap_in=[(h, b) for h, b in enumerate(new_table)]))
    for i, (k, v) in enumerate(before):
        assert torch.equal(kv.k[i][new_table], k) and torch.equal(kv.v[i][new_table], v)


def test_decoding_after_swap_in_continues_the_same_greedy_tokens(loaded):
    def run(swap: bool) -> list[int]:
        runner = ModelRunner(loaded, num_blocks=32, block_size=4, num_swap_blocks=8, sampler=greedy)
        blocks = Blocks(32, 4)
        r = request("r", [5, 6, 7, 8, 9, 10, 11])
        for s in range(6):
            if swap and s == 3:
                old = blocks.tables["r"]
                new = [blocks.free.pop() for _ in old]
                runner.execute(SchedulerOutput(step=s, blocks_to_swap_out=[(b, i) for i, b in enumerate(old)],
                                               blocks_to_swap_in=[(i, b) for i, b in enumerate(new)]))
                blocks.tables["r"] = new
            out = step(chunk(blocks, r), step_no=s)
            advance(out, runner.execute(out))
        return r.output_token_ids

    assert run(swap=True) == run(swap=False)


def test_runner_without_a_sampler_uses_the_batched_sampler(loaded):
    runner = ModelRunner(loaded, num_blocks=16, block_size=4)
    from iterserve.model.sampler import Sampler
    assert isinstance(runner.sampler, Sampler)
    blocks = Blocks(16, 4)
    r = request("r", [5, 6, 7])
    out = step(chunk(blocks, r))
    res = runner.execute(out)
    assert set(res) == {"r"}
    assert res["r"].token_id == int(runner.compute_logits(step(chunk(blocks, r))).argmax())


def test_only_chunks_that_reach_the_end_are_sampled(loaded):
    runner = ModelRunner(loaded, num_blocks=16, block_size=4, sampler=greedy)
    blocks = Blocks(16, 4)
    a, b = request("a", list(range(3, 12))), request("b", [4, 5])
    res = runner.execute(step(chunk(blocks, a, 4), chunk(blocks, b)))
    assert set(res) == {"b"}
    assert runner.execute(SchedulerOutput(step=1)) == {}


def test_kv_cache_bytes_per_block_counts_k_and_v_of_every_layer(loaded):
    c = loaded.config
    assert ModelRunner.kv_cache_bytes_per_block(c, 16, torch.float32) == \
        2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * 4
    assert ModelRunner.kv_cache_bytes_per_block(c, 16, torch.bfloat16) == \
        2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * 2


def test_bad_steps_raise_clear_errors(loaded):
    runner = ModelRunner(loaded, num_blocks=4, block_size=4, num_swap_blocks=1, sampler=greedy)
    r = request("r", list(range(3, 13)))
    with pytest.raises(ValueError, match="block table"):
        runner.execute(step(chunk_with(r, 0, 10, [0])))
    with pytest.raises(ValueError, match="tokens"):
        runner.execute(step(chunk_with(r, 8, 5, [0, 1, 2, 3])))
    with pytest.raises(KVCacheError, match="swap-out"):
        runner.execute(SchedulerOutput(step=0, blocks_to_swap_out=[(0, 5)]))


def chunk_with(r, start, n, blocks):
    from fixtures.tiny_models import Chunk
    return Chunk(r, start, n, blocks)


def test_load_model_rejects_bad_paths_dtypes_and_architectures(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    d = make_tiny_model_dir(tmp_path, "llama")
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model(str(d), dtype="float8")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="neither"):
        load_model(str(tmp_path / "weights.bin"))
    cfg = (d / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "falcon"')
    (d / "config.json").write_text(cfg)
    with pytest.raises(UnsupportedModelError, match="falcon"):
        load_model(str(d))


def test_loaded_model_reports_name_eos_and_bfloat16(tmp_path):
    d = make_tiny_model_dir(tmp_path, "qwen3", name="my-model")
    lm = load_model(str(d), dtype="bfloat16")
    assert lm.name == "my-model" and lm.config.eos_token_ids == [2]
    assert lm.model.embed_tokens.weight.dtype == torch.bfloat16
    runner = ModelRunner(lm, num_blocks=8, block_size=4, sampler=greedy)
    logits = runner.compute_logits(step(chunk(Blocks(8, 4), request("r", [5, 6, 7]))))
    assert logits.dtype == torch.float32 and logits.shape == (1, 512) and torch.isfinite(logits).all()


@pytest.mark.parametrize("mode", ["mkl", "onednn"])
def test_packed_linear_is_exact_for_any_row_count(mode):
    from iterserve.model.layers import Linear, packing_modes_available
    if mode not in packing_modes_available():
        pytest.skip(f"{mode} packed GEMM is not available in this torch build")
    torch.manual_seed(0)
    lin = Linear(96, 160, bias=True)
    torch.nn.init.normal_(lin.weight, std=0.1)
    torch.nn.init.normal_(lin.bias)
    assert lin.pack(mode)
    for rows in (1, 3, 8, 13, 64, 300):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias),
                                   atol=1e-5, rtol=1e-5)
    assert not lin.pack(None) and lin._packed is None


@pytest.mark.parametrize("mode", ["mkl", "onednn"])
def test_packed_and_plain_weights_give_the_same_logits(loaded, mode):
    def logits(pack: str | None) -> torch.Tensor:
        runner = ModelRunner(loaded, num_blocks=32, block_size=4, sampler=greedy, pack_weights=pack)
        blocks = Blocks(32, 4)
        reqs = [request(f"r{i}", [5 + i, 6, 7, 8 + i][:2 + i]) for i in range(3)]
        out = step(*[chunk(blocks, r) for r in reqs])
        advance(out, runner.execute(out))
        late = request("late", list(range(20, 31)))
        return runner.compute_logits(step(*[chunk(blocks, r) for r in reqs], chunk(blocks, late)))

    torch.testing.assert_close(logits(mode), logits(None), atol=1e-5, rtol=1e-5)
    ModelRunner(loaded, num_blocks=4, block_size=4, sampler=greedy, pack_weights=None)
    assert loaded.model.layers[0].mlp.down_proj._packed is None
