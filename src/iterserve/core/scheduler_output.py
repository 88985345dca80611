"""What one scheduler step hands to an executor (the model runner or the lab's simulator).

This is the whole contract between the torch-free core and the executors: an executor reads
each ScheduledChunk, computes `num_tokens` tokens of that request starting at position
`start` (their K/V go into the slots named by `block_ids`), and, where `sample` is true,
samples the request's next token. It returns one SampleResult per sampling chunk, and the
scheduler's `update_from_output` appends them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from iterserve.core.request import Request


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    start: int               # == request.num_computed_tokens when scheduled
    num_tokens: int          # tokens to compute this step (a prefill chunk, or 1 to decode)
    block_ids: list[int]     # the request's whole block table on the device pool

    @property
    def sample(self) -> bool:
        """True when this chunk reaches the last known token, so a new token is sampled."""
        return self.start + self.num_tokens >= self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start:self.start + self.num_tokens]

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens > 1 or self.start < self.request.num_prompt_tokens


@dataclass(slots=True)
class SchedulerOutput:
    step: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)      # evicted by recompute this step
    swapped_out: list[Request] = field(default_factory=list)    # evicted by swap this step
    swapped_in: list[Request] = field(default_factory=list)     # resumed from swap this step
    # Block copies the executor must do before the forward pass: (device, host) / (host, device)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Requests that ended outside a forward pass this step (abort, timeout): executors may
    # drop per-request state (sampler generators, ...) they keep for them.
    finished: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)


@dataclass(slots=True)
class SampleResult:
    """One sampled token, with logprobs when the request asked for them."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None   # (token_id, logprob), best first
