"""Property tests: random workloads against every combination of knobs, invariants each step.

Hypothesis draws a configuration (policy incl. `slo` with its targets, batching, preemption mode, prefix caching,
chunked prefill, tiny block pools, tiny budgets) and a script of per-step actions (arrivals
with random prompts from a 3-token vocabulary so prefixes repeat, aborts, clock jumps past
deadlines). The driver runs the scheduler with a fake executor and asserts after every step:
the token budget and max_num_seqs hold, every chunk starts at the request's computed
tokens, the block tables a data-only executor rebuilds from the SchedulerOutputs (new
requests once, then diffs) equal the block manager's own, no block is owned twice and ref counts match owners (check_consistency), static
batching never admits into a live group; with speculative decoding on (ngram, suffix, or
synthetic drafts, adaptive or not), that drafts are verified from the request's last token,
count against the budget and its blocks, and that after each step a request holds no block
past its computed tokens (the rejected drafts' blocks are back); and at the end that every
request ended with exactly its max_tokens (ignore_eos) or with the abort/timeout it was
given, and that every block is free again (cached blocks count as free). A content-tracking
executor runs each step's copies (KV tier saves, disk reads, swaps, RAM loads) and checks
that every chunk's context holds its own prefix, however its blocks got there.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.core.config import CacheConfig, SchedulerConfig
from iterserve.core.request import FinishReason, Request, RequestStatus, SamplingParams
from iterserve.core.scheduler import Scheduler
from iterserve.errors import QueueFullError


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@st.composite
def configs(draw):
    chunked = draw(st.booleans())
    max_model_len = draw(st.integers(6, 20))
    budget = draw(st.integers(1, 24)) if chunked else draw(st.integers(max_model_len, 32))
    sched = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 4)),
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=(threshold := draw(st.sampled_from([0, 0, 2, 5]))),
        max_num_partial_prefills=(partial := draw(st.integers(1, 3))),
        max_long_partial_prefills=draw(st.sampled_from(
            [None] + (list(range(1, partial + 1)) if threshold else []))),
        max_long_prefill_tokens=draw(st.sampled_from([0, 0] + ([1, 4, 9] if threshold else []))),
        priority_less_urgent_tokens=draw(st.sampled_from([0, 0, 1, 3])),
        priority_guard_steps=draw(st.sampled_from([0, 5])),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority", "slo"])),
        batching=draw(st.sampled_from(["continuous", "continuous", "static"])),
        preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
        max_queued_requests=draw(st.sampled_from([0, 0, 3])),
        queue_timeout=draw(st.sampled_from([None, None, 6.0])),
        # policy "slo": refusals, late requests and TPOT holds (smollm2-cpu seed: a 1-token
        # decode step is ~10 ms, a 12-token prefill ~35 ms).
        slo_ttft_ms=draw(st.sampled_from([None, 30.0, 200.0, 5000.0])),
        slo_tpot_ms=draw(st.sampled_from([None, 15.0, 100.0])),
        speculative_config=draw(st.sampled_from([
            None, None, None,
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 2, "adaptive": False},
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1},
            {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False},
            {"method": "synthetic", "acceptance_rates": [0.9, 0.5], "adaptive": False}])),
    )
    caching = draw(st.booleans())
    ram = draw(st.sampled_from([0, 0, 2, 8])) if caching else 0
    cache = CacheConfig(
        block_size=draw(st.integers(1, 4)),
        num_kv_blocks=draw(st.integers(2, 10)),
        num_swap_blocks=draw(st.sampled_from([0, 3, 12])),
        enable_prefix_caching=caching,
        num_ram_tier_blocks=ram,
        num_disk_tier_blocks=draw(st.sampled_from([0, 4, 30])) if ram else 0,
    )
    return sched, cache


class ContentExecutor:
    """What each KV slot holds, as a symbol: position p of a request holds its prefix
    tokens[:p + 1]. Copies (tier saves, disk reads, swaps, loads) run in the runner's order
    (model/runner.py); before a chunk computes, every position of its context must hold its
    own prefix, however the block got there (device hit, RAM, disk, swap)."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.disk: dict[str, list] = {}

    def step(self, out, held, scheduler) -> None:
        ops = out.kv_tiers
        copy = lambda blk: list(blk) if blk is not None else None   # noqa: E731
        if ops is not None:
            for block, slot in ops.ram_saves:
                self.host[slot] = copy(self.device.get(block))
            for block, digest in ops.disk_saves:
                self.disk[digest] = copy(self.device.get(block))
            for digest in ops.disk_deletes:
                self.disk.pop(digest, None)
            for digest, slot in ops.disk_reads:
                assert digest in self.disk, "a disk read of a block never written"
                self.host[slot] = copy(self.disk[digest])
        for block, host in out.blocks_to_swap_out:
            self.host[host] = copy(self.device.get(block))
        for host, block in out.blocks_to_swap_in:
            self.device[block] = copy(self.host.get(host))
        if ops is not None:
            for slot, block in ops.ram_loads:
                self.device[block] = copy(self.host.get(slot))
        bs = self.bs
        for rid, n in out.num_scheduled_tokens.items():
            r = scheduler.get_request(rid)
            # A verification computes the drafts' positions too (their KV is what an
            # accepted draft keeps), so they are written with the drafts in the prefix.
            tokens = list(r.all_token_ids) + list(out.scheduled_spec_decode_tokens.get(rid, ()))
            table, start = held[rid], r.num_computed_tokens
            for p in range(start):
                blk = self.device.get(table[p // bs])
                got = blk[p % bs] if blk is not None else None
                assert got == tuple(tokens[:p + 1]), (
                    f"{rid}: position {p} of its context holds {got}, not its prefix")
            for p in range(start, start + n):
                self.device.setdefault(table[p // bs], [None] * bs)[p % bs] = \
                    tuple(tokens[:p + 1])


arrival = st.tuples(
    st.just("arrive"),
    st.lists(st.integers(0, 2), min_size=1, max_size=12),     # prompt
    st.integers(1, 8),                                        # max_tokens
    st.integers(0, 2),                                        # priority
    st.sampled_from([None, None, None, 3.0, 20.0]),          # deadline (seconds from now)
)
abort = st.tuples(st.just("abort"), st.integers(0, 50))
jump = st.tuples(st.just("jump"), st.sampled_from([1.0, 5.0]))
scripts = st.lists(st.lists(st.one_of(arrival, arrival, abort, jump), max_size=3), max_size=25)


def run(sched_cfg, cache_cfg, script):
    clock = Clock()
    s = Scheduler(sched_cfg, cache_cfg, clock=clock)
    accepted: list[Request] = []
    aborted: set[str] = set()
    group: set[str] = set()               # static: members admitted since the group formed
    group_live: set[str] = set()          # ... and not finished yet
    held: dict[str, list[int]] = {}       # block tables as an executor rebuilds them
    content = ContentExecutor(cache_cfg.block_size)
    max_steps = 4000
    k = 0
    while k < max_steps:
        for action in (script[k] if k < len(script) else ()):
            if action[0] == "arrive":
                _, prompt, max_tokens, priority, deadline = action
                r = Request(f"r{len(accepted)}-{k}", prompt,
                            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                            priority=priority, arrival_time=clock.t, eos_token_id=0,
                            deadline=None if deadline is None else clock.t + deadline)
                try:
                    s.add_request(r)
                except QueueFullError:
                    continue
                except ValueError:
                    too_long = len(prompt) >= sched_cfg.max_model_len
                    final = min(len(prompt) + max_tokens, sched_cfg.max_model_len)
                    too_big = -(-(final - 1) // cache_cfg.block_size) > cache_cfg.num_kv_blocks
                    assert too_long or too_big, "a request that fits was rejected"
                    continue
                accepted.append(r)
            elif action[0] == "abort" and accepted:
                r = accepted[action[1] % len(accepted)]
                if s.finish_request(r.request_id, FinishReason.ABORT) is not None:
                    aborted.add(r.request_id)
                    group_live.discard(r.request_id)
            elif action[0] == "jump":
                clock.t += action[1]
        if k >= len(script) and not s.has_unfinished_requests():
            break

        before = {r.request_id: r.num_computed_tokens for r in s.running}
        out = s.schedule()
        s.check_consistency()
        sched_tokens = out.num_scheduled_tokens
        assert out.num_batched_tokens == sum(sched_tokens.values())
        assert out.num_batched_tokens <= sched_cfg.max_num_batched_tokens
        assert len(sched_tokens) <= sched_cfg.max_num_seqs
        assert s.num_running <= sched_cfg.max_num_seqs
        # The executor's side of the seam: state from data only.
        for rid in out.finished_req_ids + out.preempted_req_ids:
            held.pop(rid, None)
        for rid, keep in out.truncated_block_tables.items():
            if rid in held:
                del held[rid][keep:]
        for d in out.scheduled_new_reqs:
            r = s.get_request(d.req_id)
            assert d.req_id not in held, "a held request was sent whole again"
            assert d.prompt_token_ids + d.output_token_ids == r.all_token_ids
            held[d.req_id] = list(d.block_ids)
        for d in out.scheduled_cached_reqs:
            assert d.req_id in held, f"a diff for {d.req_id}, which the executor never got"
            if d.resumed_from_preemption:
                held[d.req_id] = list(d.new_block_ids)
            else:
                held[d.req_id].extend(d.new_block_ids)
        data = out.scheduled_new_reqs + out.scheduled_cached_reqs
        assert sorted(d.req_id for d in data) == sorted(sched_tokens)
        drafts = out.scheduled_spec_decode_tokens
        assert set(drafts) <= set(sched_tokens)
        for d in data:
            rid, n = d.req_id, sched_tokens[d.req_id]
            r = s.get_request(rid)
            assert n >= 1 and d.num_computed_tokens == r.num_computed_tokens
            if rid in drafts:                # a verification: from its last token on
                assert d.num_computed_tokens == r.num_tokens - 1
                assert n == 1 + len(drafts[rid]) and drafts[rid]
                assert r.num_tokens + len(drafts[rid]) <= sched_cfg.max_model_len
                assert r.num_output_tokens + len(drafts[rid]) < r.sampling_params.max_tokens
            else:
                assert d.num_computed_tokens + n <= r.num_tokens
            if rid in before:
                assert d.num_computed_tokens == before[rid]
            assert held[rid] == s.block_manager.block_table(rid)
            assert len(held[rid]) * cache_cfg.block_size >= d.num_computed_tokens + n
        if sched_cfg.batching == "static":
            # A group forms only when every earlier member has finished, and never grows past
            # max_num_seqs (no refill of freed slots while the group runs).
            group_live.difference_update(out.ended_req_ids)
            if not group_live:
                group.clear()
            newly = {rid for rid in sched_tokens
                     if len(s.get_request(rid).events) >= 2
                     and s.get_request(rid).events[-2].name == "scheduled"
                     and s.get_request(rid).events[-2].step == out.step}
            group |= newly
            group_live |= newly
            assert len(group) <= sched_cfg.max_num_seqs, "static refilled a live group"
        content.step(out, held, s)
        sampled = {}
        for d in data:
            r = s.get_request(d.req_id)
            own = 1 + (k + d.num_computed_tokens) % 3
            if d.req_id in drafts:           # accept some of the drafts, then a token of its own
                proposed = drafts[d.req_id]
                taken = (k + d.num_computed_tokens) % (len(proposed) + 1)
                sampled[d.req_id] = proposed[:taken] + [own]
            elif d.num_computed_tokens + sched_tokens[d.req_id] >= r.num_tokens:
                sampled[d.req_id] = own
        finished = s.update_from_output(out, sampled)
        s.check_consistency()
        bs = cache_cfg.block_size
        for rid in drafts:
            r = s.get_request(rid)
            if r is not None and r.status is RequestStatus.RUNNING:
                assert s.block_manager.num_device_blocks(rid) == -(-r.num_computed_tokens // bs), \
                    "a rejected draft's block was kept"
        for r in finished:
            group_live.discard(r.request_id)
        clock.t += 0.25
        k += 1
    assert not s.has_unfinished_requests(), f"did not drain in {max_steps} steps"

    bm = s.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    assert bm.num_free_host_blocks == bm.num_swap_blocks, "swap blocks leaked"
    assert not bm.device_owners() and all(bm.num_host_blocks(r.request_id) is None
                                          for r in accepted)
    out = s.schedule()                    # the last finishes reach the executor
    for rid in out.finished_req_ids:
        held.pop(rid, None)
    assert not held, f"the executor was never told that {sorted(held)} finished"
    for r in accepted:
        assert r.status is RequestStatus.FINISHED
        if r.finish_reason is FinishReason.ABORT:
            assert r.request_id in aborted
        elif r.finish_reason is FinishReason.TIMEOUT:
            ends = [d for d in (r.deadline, r.queue_deadline) if d is not None]
            assert ends and r.finished_time >= min(ends)
            if r.deadline is None or r.finished_time < r.deadline:
                assert r.first_scheduled_time is None, "queue timeout after admission"
        else:
            assert r.finish_reason is FinishReason.LENGTH
            expected = min(r.sampling_params.max_tokens,
                           sched_cfg.max_model_len - r.num_prompt_tokens)
            assert r.num_output_tokens == expected
            assert r.request_id not in aborted
    return s


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), scripts)
def test_random_workloads_keep_every_invariant_and_drain(cfg, script):
    run(*cfg, script)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["fcfs", "priority"]), st.sampled_from(["recompute", "swap"]),
       st.booleans(), st.lists(st.tuples(st.integers(1, 10), st.integers(1, 6)),
                               min_size=1, max_size=12))
def test_every_request_gets_exactly_max_tokens_under_heavy_kv_pressure(
        policy, mode, caching, reqs):
    """A pool barely larger than one request forces constant preemption; nothing is lost."""
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=32,
                            scheduling_policy=policy, preemption_mode=mode)
    cache = CacheConfig(block_size=2, num_kv_blocks=8, num_swap_blocks=6,
                        enable_prefix_caching=caching)
    script = [[("arrive", [1] * p, m, i % 3, None)] for i, (p, m) in enumerate(reqs)]
    s = run(sched, cache, script)
    assert s.stats().num_running == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 2), st.integers(5, 9), st.integers(1, 3), st.integers(4, 40),
       st.sampled_from(["recompute", "swap"]),
       st.lists(st.tuples(st.lists(st.integers(0, 1), min_size=2, max_size=10),
                          st.integers(1, 3)), min_size=2, max_size=16))
def test_kv_tiers_under_pressure_keep_every_context_right(block_size, blocks, ram, disk, mode,
                                                          reqs):
    """A pool of a few blocks, a RAM tier of one to three: cached blocks go to RAM, fall out
    to disk and are read back (promoted) while prompts that share prefixes come and go."""
    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16,
                            preemption_mode=mode)
    cache = CacheConfig(block_size=block_size, num_kv_blocks=blocks, num_swap_blocks=4,
                        num_ram_tier_blocks=ram, num_disk_tier_blocks=disk)
    script = [[("arrive", p, m, 0, None)] if i % 2 == 0 else []
              for i, (p, m) in enumerate(x for r in reqs for x in (r, r))]
    run(sched, cache, script)
@settings(max_examples=80, deadline=None)
@given(st.sampled_from(["fcfs", "priority"]), st.sampled_from(["recompute", "swap"]),
       st.booleans(), st.booleans(), st.sampled_from(["ngram", "suffix", "synthetic"]),
       st.lists(st.tuples(st.integers(1, 10), st.integers(1, 20)), min_size=1, max_size=10))
def test_speculation_under_kv_pressure_keeps_every_invariant(
        policy, mode, caching, chunked, method, reqs):
    """Speculative decoding on every step it can: drafts from a 3-token vocabulary are
    proposed nearly always, some accepted, under constant preemption; nothing leaks."""
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    if method == "synthetic":
        spec["acceptance_rates"] = [0.8, 0.6, 0.3]
    sched = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=10 if chunked else 48,
                            max_model_len=48, scheduling_policy=policy, preemption_mode=mode,
                            enable_chunked_prefill=chunked, speculative_config=spec)
    cache = CacheConfig(block_size=2, num_kv_blocks=14, num_swap_blocks=8,
                        enable_prefix_caching=caching)
    script = [[("arrive", [i % 3, 1, 2, 1][:1 + p % 4] * (1 + p // 4), m, i % 3, None)]
              for i, (p, m) in enumerate(reqs)]
    s = run(sched, cache, script)
    assert s.stats().num_running == 0
