"""The prefix-aware router against round robin on a shared-prefix workload, through real
HTTP: prefix_aware sends each prefix's requests to the replica that already holds its
blocks, round robin spreads every prefix over both replicas, whose small KV pools then evict
each other's prefixes. The prefix-cache hit rate (hits / looked-up blocks, summed over the
replicas, as their engines count them) must be at least 2x round robin's."""

from __future__ import annotations

import random

import httpx
import openai

NUM_PREFIXES = 7             # odd: round robin alternates each prefix's replica
REQUESTS_PER_PREFIX = 6
PREFIX_BLOCKS = 4            # x block_size 16 = 64 shared tokens
KV_BLOCKS = 20               # per replica: ~4 prefixes + one running request fit


def workload(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(PREFIX_BLOCKS * 16)]
                for _ in range(NUM_PREFIXES)]
    order = [i for _ in range(REQUESTS_PER_PREFIX) for i in range(NUM_PREFIXES)]
    return [prefixes[i] + [rng.randrange(3, 500) for _ in range(5)] for i in order]


def hit_rate(start_pool, router: str) -> float:
    s = start_pool(router=router, enable_prefix_caching=True, num_kv_blocks=KV_BLOCKS)
    c = openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0, timeout=60)
    for prompt in workload():
        r = c.completions.create(model="tiny-llama", prompt=[prompt], max_tokens=2,
                                 temperature=0)
        assert r.usage.completion_tokens == 2
    stats = httpx.get(s.base_url + "/v1/engine/stats").json()
    assert stats["num_cache_queries"] > 0
    s.stop()                                   # free the replicas before the next pool
    from iterserve.replicas import close_pool
    close_pool(s.engine, shutdown_ray=False)
    return stats["prefix_cache_hit_rate"]


def test_prefix_aware_hit_rate_is_at_least_twice_round_robin(start_pool):
    rr = hit_rate(start_pool, "round_robin")
    pa = hit_rate(start_pool, "prefix_aware")
    print(f"\n[replicas] prefix-cache hit rate: round_robin {rr:.3f}, prefix_aware {pa:.3f}")
    assert pa >= 2 * rr and pa > 0.5, (rr, pa)
