"""EngineArgs: vLLM's flag spellings, CPU defaults, and the KV pool sized from memory."""

from __future__ import annotations

import argparse

import pytest

from iterserve.engine.args import GiB, EngineArgs
from iterserve.errors import ConfigError


def parse(*argv: str) -> EngineArgs:
    return EngineArgs.from_cli_args(EngineArgs.add_cli_args(argparse.ArgumentParser())
                                    .parse_args(list(argv)))


def test_every_scheduler_knob_has_a_vllm_spelled_flag():
    a = parse("--model", "m", "--max-num-seqs", "8",
              "--max-model-len", "512", "--block-size", "8", "--num-kv-blocks", "100",
              "--swap-space", "0.001", "--no-enable-chunked-prefill",
              "--long-prefill-token-threshold", "64", "--max-num-partial-prefills", "2",
              "--scheduling-policy", "priority", "--preemption-mode", "swap",
              "--batching", "static", "--enable-prefix-caching", "--max-queued-requests", "5",
              "--request-timeout", "30", "--dtype", "bfloat16", "--device", "cpu")
    s = a.create_scheduler_config(model_limit=1024)
    c = a.create_cache_config(bytes_per_block=4096)
    assert (s.max_num_seqs, s.max_model_len, s.scheduling_policy, s.batching, s.preemption_mode) == (
        8, 512, "priority", "static", "swap")
    assert s.enable_chunked_prefill is False and s.max_num_batched_tokens == 512  # raised to fit
    assert (s.long_prefill_token_threshold, s.max_num_partial_prefills) == (64, 2)
    assert (s.max_queued_requests, s.request_timeout) == (5, 30.0)
    assert (c.block_size, c.num_kv_blocks, c.enable_prefix_caching) == (8, 100, True)
    assert c.num_swap_blocks == int(0.001 * GiB // 4096)
    assert (a.model, a.dtype, a.device) == ("m", "bfloat16", "cpu")


def test_defaults_suit_a_cpu_and_size_the_pool_from_kv_cache_memory():
    a = parse()
    s = a.create_scheduler_config(model_limit=8192)
    assert s.max_num_seqs == 32 and s.max_num_batched_tokens == 256
    assert s.max_model_len == 2048 and s.enable_chunked_prefill
    c = a.create_cache_config(bytes_per_block=1 << 20)
    assert c.num_kv_blocks == 1024 and c.num_swap_blocks == 0      # 1 GiB / 1 MiB


def test_swap_mode_without_swap_space_gets_a_pool_as_large_as_the_device_pool():
    c = parse("--preemption-mode", "swap", "--num-kv-blocks", "40").create_cache_config()
    assert c.num_swap_blocks == 40


@pytest.mark.parametrize("argv, bpb", [
    (("--max-model-len", "4096"), 1024),          # beyond the model's limit
    (("--max-num-seqs", "0"), 1024),
    (("--kv-cache-memory", "0"), 1024),
    (("--kv-cache-memory", "0.000001"), 1 << 20),  # not even one block
])
def test_impossible_settings_raise_config_errors(argv, bpb):
    a = parse(*argv)
    with pytest.raises(ConfigError):
        a.create_scheduler_config(model_limit=2048)
        a.create_cache_config(bytes_per_block=bpb)


def test_bad_choice_is_an_argparse_error():
    with pytest.raises(SystemExit):
        parse("--scheduling-policy", "random")


def test_an_explicit_budget_below_max_model_len_without_chunking_is_refused_by_name():
    a = parse("--max-num-batched-tokens", "128", "--no-enable-chunked-prefill",
              "--max-model-len", "512")
    with pytest.raises(ConfigError, match="max_num_batched_tokens") as e:
        a.create_scheduler_config(model_limit=1024)
    assert e.value.knob == "max_num_batched_tokens"


def test_every_config_knob_is_an_engine_arg_and_a_flag():
    import dataclasses

    from iterserve.core.config import CacheConfig, SchedulerConfig, knob_fields
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    help_text = EngineArgs.add_cli_args(argparse.ArgumentParser()).format_help()
    for cls in (SchedulerConfig, CacheConfig):
        for name, _, k in knob_fields(cls):
            assert name in names
            assert "--" + name.replace("_", "-") in help_text
            assert k.help.split("(")[0].strip()[:20] in " ".join(help_text.split())


def test_an_in_process_engine_refuses_data_parallel_replicas():
    """-dp N is the server's (Ray Serve replicas); LLM / `iterserve generate` must not run
    one engine quietly when asked for N."""
    import pytest

    from iterserve.engine.builder import build_engine_parts

    with pytest.raises(ConfigError, match="data_parallel_size 2.*iterserve serve"):
        build_engine_parts(EngineArgs(data_parallel_size=2))
