"""What one scheduler step hands to an executor (the model runner, the lab, calibration).

This is the whole contract between the torch-free core and the executors, and it is plain
data (vLLM v1's NewRequestData / CachedRequestData): no live `Request`, no list aliased to
the block manager's tables, so an executor could live in another process (tensor-parallel
ranks, replicas) and receive it as a message.

- A request the executor has not seen, or must rebuild, comes once as `NewRequestData`:
  its id, prompt, outputs so far (non-empty only when it is resumed after a recompute
  preemption), sampling params, whole block table and computed tokens.
- Every later step it comes as `CachedRequestData`: only the new block ids (appended to
  the executor's table; the whole new table when `resumed_from_preemption`, i.e. after a
  swap-in) and where this step's tokens start.
- `num_scheduled_tokens` says how many tokens each scheduled request computes this step,
  in scheduling order. The executor computes tokens [num_computed_tokens, + n) from its own
  copy of the request's tokens; when that reaches the last token it knows, it samples one
  more and appends it to its copy (the scheduler appends the same token in
  `update_from_output`).
- `finished_req_ids`: every request finished since the previous step (any reason); the
  executor drops its state for them. `ended_req_ids` is the subset ended by
  `Scheduler.finish_request` (abort, timeout, stop string, error) rather than by a sampled
  token: the engine reports those. `preempted_req_ids` (recompute: the request will come
  back as new data) and `swapped_out_req_ids` / `swapped_in_req_ids` are informational.
- Swap copies (`blocks_to_swap_out/in`) are done before the forward pass.
- `kv_tiers` (core/kv_tiers.py): the step's copies between the device pool and the tiers
  below it (host RAM slots, a disk directory), `KVTierOps`; None when there are none. The
  executor reports back failed reads and writes and measured costs as a `KVTierFeedback`.
- `scheduled_spec_decode_tokens` (vLLM's name): for a request verifying drafts this step,
  its draft tokens. Such a request's `num_scheduled_tokens` is 1 + len(drafts): its last
  known token and the drafts after it, at positions num_computed_tokens.. (the drafts are
  not in the executor's copy of the request). The executor computes all of them, samples at
  each of the 1 + len(drafts) positions, accepts the drafts up to the first that differs
  from its own sample, and returns the accepted drafts plus the token at the first
  differing position (or after the last draft): 1 to 1 + len(drafts) tokens
  (`SampleResult.verified`). `DRAFT_PLACEHOLDER` drafts are proposed by the executor itself
  (a draft model). The blocks the rejected drafts took are returned by the scheduler when
  the tokens come back; the next step's `truncated_block_tables` says, per request, how many
  blocks its table keeps (applied before that step's new block ids).
- `grammar_bitmask` is not the scheduler's: the engine sets it after schedule() when some
  sequences sampling in this step are constrained (structured outputs). It is data too (a
  structured.bitmask.GrammarBitmask: an int32 bit-per-token tensor and the sequence id of
  each row); the executor applies it to those sequences' logits before sampling.

One SampleResult per sampling request comes back through `Scheduler.update_from_output`
(its token ids: `token_ids`, one, or several after a verification). A pooling request
(`NewRequestData.pooling_params`) samples nothing: the step that computes its last prompt
token returns a `PoolingOutput` for it (the pooled vector, for the engine), and the
scheduler finishes it there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from iterserve.core.request import PoolingParams, SamplingParams
from iterserve.structured.params import verify_row_id  # noqa: F401 (the executors read it here)


@dataclass(slots=True)
class NewRequestData:
    """A request sent whole: first admission, or re-admission after recompute preemption."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[int, ...]        # the whole device block table
    num_computed_tokens: int          # where this step's tokens start (prefix-cache hits)
    output_token_ids: list[int] = field(default_factory=list)   # resumed: outputs so far
    # A pooling request (core.request.PoolingParams): computed, pooled, never sampled.
    pooling_params: PoolingParams | None = None


@dataclass(slots=True)
class CachedRequestData:
    """A request the executor already holds: this step's diff."""

    req_id: str
    new_block_ids: tuple[int, ...]    # appended to the table (replace it when resumed)
    num_computed_tokens: int          # where this step's tokens start
    resumed_from_preemption: bool = False   # swapped back in: new_block_ids is the table


@dataclass(slots=True)
class KVTierOps:
    """Copies between the device pool and the KV tiers below it, for one step.

    Host slots are indices into the executor's host pool (the RAM tier's slots follow the
    swap pool's); digests are hex strings (core/kv_tiers.py), a block file's name. The
    executor does them before the forward pass, in this order, so no copy reads a block a
    later one overwrites: the saves (which read device blocks) before the swaps and loads
    (which write them), a slot's pending disk read before anything else touches the slot.

    - `ram_saves` (device block, host slot): a cached block the pool evicts this step,
      kept in RAM.
    - `disk_saves` (device block, digest): a block computed and cached in the last step,
      written through to disk (the write itself may finish later, off the step).
    - `disk_deletes`: files evicted from the disk tier.
    - `disk_reads` (digest, host slot): blocks read back from disk into RAM, off the step
      (a request whose blocks these are is admitted next step, with RAM hits).
    - `ram_loads` (host slot, device block): RAM hits copied into the fresh device blocks
      of a request admitted this step (after the swaps).
    """

    ram_saves: list[tuple[int, int]] = field(default_factory=list)
    disk_saves: list[tuple[int, str]] = field(default_factory=list)
    disk_deletes: list[str] = field(default_factory=list)
    disk_reads: list[tuple[str, int]] = field(default_factory=list)
    ram_loads: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.ram_saves or self.disk_saves or self.disk_deletes or self.disk_reads
                    or self.ram_loads)


@dataclass(slots=True)
class KVTierFeedback:
    """What an executor reports about the tier ops it ran (KVTierOps), for the block
    manager's books and its cost model.

    - `failed_reads` (digest, host slot): a disk read found its file missing, torn or
      corrupt (a checksum or key mismatch); the slot does not hold that digest.
    - `failed_writes`: digests whose file could not be written (a full disk, an I/O error,
      a writer too far behind).
    - `invalid_blocks`: device blocks a failed load left without their data that no chunk
      of the step recomputed (their cache keys must go).
    - `load_s` tier -> (seconds, blocks) of the loads it timed; `compute_s` /
      `compute_tokens`: a forward pass with enough prompt tokens to price a recompute.
    """

    failed_reads: list[tuple[str, int]] = field(default_factory=list)
    failed_writes: list[str] = field(default_factory=list)
    invalid_blocks: list[int] = field(default_factory=list)
    load_s: dict[str, tuple[float, int]] = field(default_factory=dict)
    compute_s: float = 0.0
    compute_tokens: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    step: int
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # Tokens each scheduled request computes this step, in scheduling order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    num_batched_tokens: int = 0       # == sum(num_scheduled_tokens.values())
    finished_req_ids: list[str] = field(default_factory=list)
    ended_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)     # by recompute this step
    swapped_out_req_ids: list[str] = field(default_factory=list)   # by swap this step
    swapped_in_req_ids: list[str] = field(default_factory=list)    # resumed from swap
    # Block copies the executor must do before the forward pass: (device, host) / (host, device)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Copies to and from the KV tiers (host RAM, disk), before the forward pass (KVTierOps).
    kv_tiers: KVTierOps | None = None
    # Drafts verified this step, by request (see above).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Tables cut since the last step (rejected drafts' blocks returned): request -> blocks
    # kept. Executors cut their copy before applying this step's new block ids.
    truncated_block_tables: dict[str, int] = field(default_factory=dict)
    # Set by the engine, not the scheduler: the constrained rows' token masks (see above).
    grammar_bitmask: Any = None

    @property
    def is_empty(self) -> bool:
        """True when there is nothing for an executor to do (no tokens, copies or state to
        drop): the engine then skips the executor call."""
        return not (self.num_scheduled_tokens or self.blocks_to_swap_in
                    or self.blocks_to_swap_out or self.finished_req_ids
                    or self.preempted_req_ids or self.kv_tiers
                    or self.truncated_block_tables)

    @property
    def num_seqs(self) -> int:
        return len(self.num_scheduled_tokens)

    @property
    def num_preemptions(self) -> int:
        return len(self.preempted_req_ids) + len(self.swapped_out_req_ids)


class SamplingRow(Protocol):
    """What a sampler reads of one row: the executor's own per-request state, never the
    scheduler's live Request (penalties see prompt + outputs, seeds the output count)."""

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...


@dataclass(slots=True)
class SampleResult:
    """One sampled token, with logprobs when the request asked for them."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None   # (token_id, logprob), best first
    # With the request's first sampled token, when it asked for prompt_logprobs: one entry
    # per prompt position from the second on, (token id, logprob, rank, [(id, logprob)] top-k).
    prompt_logprobs: list[tuple[int, float, int, list[tuple[int, float]]]] | None = None
    # After a verification of drafts: the results of the tokens that follow this one in the
    # same step (accepted drafts, then the executor's own token), in order.
    verified: list["SampleResult"] | None = None

    @property
    def token_ids(self) -> list[int]:
        """This step's tokens for the request: one, or 1 + accepted drafts."""
        if not self.verified:
            return [self.token_id]
        return [self.token_id, *(r.token_id for r in self.verified)]


@dataclass(slots=True)
class PoolingOutput:
    """A pooling request's result: its pooled vector (an executor's float32 array; the core
    only carries it) and how many prompt tokens it pooled."""

    data: Any
    num_tokens: int = 0
