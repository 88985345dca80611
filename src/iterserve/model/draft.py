"""`draft_model` speculative decoding: a smaller model with the target's vocabulary proposes
each verification's drafts, greedily, just before the target verifies them.

Why in the executor: the drafts come from the draft model's forward passes over the
request's tokens, which only the executor runs. The scheduler reserves k placeholder tokens
(core/spec_decode/ngram.py `DraftModelProposer`), so the drafts count against the token
budget and the KV blocks like any token, and the adaptive plan decides how many to verify.

The draft's KV lives in a pool of its own (its own `ModelRunner`) with the target's block
count and size, indexed by the target's block tables: the one block manager books both, a
block freed is freed for both, and swaps copy both pools with the same mappings.

Per request the proposer keeps how many leading positions of the draft's pool hold the KV
of the request's tokens (`valid`). For a verification of k drafts from position `start` (the
request's last token) it runs the draft over the tokens from `valid` to `start` (the whole
prompt the first time: prefix-cached blocks hold the target's KV, not the draft's) and then
k - 1 one-token steps, the verifying requests batched in each. Each step's greedy token is a
draft. Once the target accepted a of them, the draft's KV is right up to position
start + min(a, k - 1), because the accepted drafts were its own inputs. A preemption or a
resume starts the request over (valid = 0), and a cut block table caps it.
"""

from __future__ import annotations

import torch

from iterserve.core.scheduler_output import SchedulerOutput


class DraftProposer:
    """The target runner's draft model: `update` with every step's data, `propose` for the
    step's verifications, `accepted` with their outcome."""

    def __init__(self, runner) -> None:
        self.runner = runner                 # a ModelRunner of the draft model
        self.valid: dict[str, int] = {}
        self.forward_passes = 0              # draft forward passes run (one per draft depth)

    def update(self, output: SchedulerOutput) -> None:
        """Before the target's step: forget ended requests, start resumed or preempted ones
        over, cap cut tables, and copy the step's swaps in the draft's pool too."""
        valid = self.valid
        for rid in (*output.finished_req_ids, *output.preempted_req_ids):
            valid.pop(rid, None)
        bs = self.runner.block_size
        for rid, keep in output.truncated_block_tables.items():
            if rid in valid:
                valid[rid] = min(valid[rid], keep * bs)
        for d in output.scheduled_new_reqs:
            valid.pop(d.req_id, None)
        for d in output.scheduled_cached_reqs:
            if d.resumed_from_preemption:
                valid.pop(d.req_id, None)
        kv = self.runner.kv_cache
        kv.swap_out(output.blocks_to_swap_out)
        kv.swap_in(output.blocks_to_swap_in)

    def propose(self, items: list[tuple[str, list[int], int, int, list[int]]]
                ) -> dict[str, list[int]]:
        """{request id: its k drafts} for items (request id, its tokens, start = the index of
        its last token, k, its block table)."""
        drafts: dict[str, list[int]] = {rid: [] for rid, *_ in items}
        chunks = []
        for rid, tokens, start, _, blocks in items:
            first = min(self.valid.get(rid, 0), start)
            chunks.append((tokens[first:start + 1], first, blocks))
        live = list(items)
        depth = 0
        while live:
            with torch.inference_mode():
                logits = self.runner.forward_last_logits(chunks)
            self.forward_passes += 1
            picks = logits.argmax(dim=-1).tolist()
            depth += 1
            chunks, nxt = [], []
            for (rid, tokens, start, k, blocks), tok in zip(live, picks):
                drafts[rid].append(tok)
                if depth < k:
                    chunks.append(([tok], start + depth, blocks))
                    nxt.append((rid, tokens, start, k, blocks))
            live = nxt
        return drafts

    def accepted(self, rid: str, start: int, k: int, num_accepted: int) -> None:
        """The target kept `num_accepted` of the k drafts proposed from `start`."""
        self.valid[rid] = start + 1 + min(num_accepted, k - 1)

    def __len__(self) -> int:
        return len(self.valid)
