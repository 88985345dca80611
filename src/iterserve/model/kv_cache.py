"""The paged KV cache: one K and one V pool per layer, plus a host pool (swap, RAM tier).

Layout per layer: [num_blocks, block_size, num_kv_heads, head_dim]. Token position p of a
request lives in slot `block_ids[p // block_size] * block_size + p % block_size` of the
pool viewed as [num_blocks * block_size, kv_heads * head_dim], so writing a step's new K/V is
one index_copy_ and reading a sequence's context is one index_select with precomputed slot
indices (computed once per step and shared by all layers, see attention.AttentionMetadata).

Allocation: on CPU the pools are one anonymous private mapping (`lazy_zeros`), not
`torch.zeros`. The kernel hands out a zero page the first time a page is touched, so the
pools read as zeros exactly as before (the padded SDPA path reads slots past a sequence's
length, and a 0 * NaN from uninitialised memory there would poison the output), yet nothing
is written at start: a 1.5 GiB pool took 3.7-20 s to zero-fill at start under load, and now
costs nothing until used, and RSS grows as the cache fills (as llama.cpp's does).

The host pool holds `num_swap_blocks` slots for swap preemption followed by the RAM tier's
`num_tier_blocks` slots (core/kv_tiers.py): both are the same copies (`swap_out` device ->
host, `swap_in` host -> device), so the tiers move bytes with the swap mechanism. A block's
whole K/V (every layer) is one strided view of the pools (`block_view`, `host_view`: all
layers sit in one allocation), which is what the disk tier writes and reads back.
"""

from __future__ import annotations

import math
import mmap

import torch

from iterserve.errors import KVCacheError
from iterserve.model.config import ModelConfig
from iterserve.model.startup import phase


# Below this a plain torch.zeros is as cheap and keeps small pools on the allocator.
_LAZY_MIN_BYTES = 1 << 20


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages are supplied by the kernel on first touch.

    An anonymous private mapping is zero-filled by definition (POSIX MAP_ANONYMOUS), so
    this is `torch.zeros` without writing anything: untouched pages take neither time nor
    RSS. The tensor holds the mapping (torch.frombuffer keeps its buffer alive); the
    mapping is unmapped when the last view of it goes."""
    elem = torch.empty(0, dtype=dtype).element_size()
    nbytes = math.prod(shape) * elem
    if nbytes < _LAZY_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


class PagedKVCache:
    def __init__(self, config: ModelConfig, *, num_blocks: int, block_size: int,
                 num_swap_blocks: int = 0, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu", num_tier_blocks: int = 0,
                 layer_blocks: list[int] | None = None) -> None:
        """`layer_blocks`: blocks of each layer's pools where they differ from num_blocks
        (sliding-window layers with a pool of their own, core/sliding_window.py); swap
        copies cover only layers of num_blocks, and whole-block views (the KV tiers) need
        one pool size, so the runner uses window pools only without swap or tiers."""
        if num_blocks < 1 or block_size < 1 or num_swap_blocks < 0 or num_tier_blocks < 0:
            raise KVCacheError(
                f"need num_blocks >= 1, block_size >= 1, num_swap_blocks >= 0, "
                f"num_tier_blocks >= 0; got {num_blocks}, {block_size}, {num_swap_blocks}, "
                f"{num_tier_blocks}")
        self.num_blocks, self.block_size, self.num_swap_blocks = num_blocks, block_size, num_swap_blocks
        self.num_tier_blocks = num_tier_blocks
        self.num_host_blocks = num_host = num_swap_blocks + num_tier_blocks
        self.dtype = dtype or config.dtype
        self.device = torch.device(device)
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        L = config.num_layers
        self.layer_blocks = list(layer_blocks) if layer_blocks else [num_blocks] * L
        if len(self.layer_blocks) != L or min(self.layer_blocks) < 1:
            raise KVCacheError(f"layer_blocks {self.layer_blocks} is not one count per layer")
        with phase("kv_alloc"):
            self._pools = None
            if len(set(self.layer_blocks)) == 1 and self.layer_blocks[0] == num_blocks:
                if self.device.type == "cpu":
                    pools = lazy_zeros((2, L, *shape), self.dtype)
                else:
                    pools = torch.zeros((2, L, *shape), dtype=self.dtype, device=self.device)
                self._pools = pools
                self.k, self.v = list(pools[0].unbind(0)), list(pools[1].unbind(0))
            else:
                self.k, self.v = [None] * L, [None] * L
                for n in sorted(set(self.layer_blocks)):
                    idx = [i for i, b in enumerate(self.layer_blocks) if b == n]
                    lshape = (n, *shape[1:])
                    if self.device.type == "cpu":
                        pools = lazy_zeros((2, len(idx), *lshape), self.dtype)
                        ks, vs = pools[0].unbind(0), pools[1].unbind(0)
                    else:
                        ks = [torch.zeros(lshape, dtype=self.dtype, device=self.device)
                              for _ in idx]
                        vs = [torch.zeros(lshape, dtype=self.dtype, device=self.device)
                              for _ in idx]
                    for i, kt, vt in zip(idx, ks, vs):
                        self.k[i], self.v[i] = kt, vt
        # Flat 2-D views addressed by slot: [num_blocks * block_size, kv_heads * head_dim].
        # 2-D because index_select/index_copy_ over 2-D rows was measured ~4x faster than
        # over [slots, kv_heads, head_dim].
        self.k_slots = [t.view(-1, shape[2] * shape[3]) for t in self.k]
        self.v_slots = [t.view(-1, shape[2] * shape[3]) for t in self.v]
        swap_shape = (num_host, *shape[1:])
        if self.device.type == "cuda":     # pinned host memory for the copies
            swaps = torch.zeros((2, L, *swap_shape), dtype=self.dtype, pin_memory=True)
        else:
            swaps = lazy_zeros((2, L, *swap_shape), self.dtype)
        self._host = swaps
        self.swap_k, self.swap_v = list(swaps[0].unbind(0)), list(swaps[1].unbind(0))
        # One block's K/V, every layer: [2, layers, block_size, kv_heads, head_dim].
        self.block_shape = (2, L, *shape[1:])

    @property
    def nbytes(self) -> int:
        """Bytes of the device pools (every layer's K and V)."""
        return sum(2 * t.numel() * t.element_size() for t in self.k)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem

    def block_view(self, block: int) -> torch.Tensor:
        """Device block `block`'s K/V, every layer, as a (strided) view of the pools."""
        if not 0 <= block < self.num_blocks:
            raise KVCacheError(f"block {block} is outside the pool of {self.num_blocks}")
        if self._pools is None:
            raise KVCacheError("whole-block views need every layer's pool of num_blocks "
                               "(sliding-window pools are for runs without swap or KV tiers)")
        return self._pools[:, :, block]

    def host_view(self, slot: int) -> torch.Tensor:
        """Host slot `slot`'s K/V, every layer (a view: writing it fills the slot)."""
        if not 0 <= slot < self.num_host_blocks:
            raise KVCacheError(f"host slot {slot} is outside the host pool of "
                               f"{self.num_host_blocks}")
        return self._host[:, :, slot]

    def _check(self, pairs: list[tuple[int, int]], src_n: int, dst_n: int, what: str) -> None:
        for src, dst in pairs:
            if not (0 <= src < src_n and 0 <= dst < dst_n):
                raise KVCacheError(f"{what} pair ({src}, {dst}) is outside the pools "
                                   f"({src_n} source / {dst_n} destination blocks)")

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (device block, host block) pairs device -> host."""
        if not pairs:
            return
        self._check(pairs, self.num_blocks, self.num_host_blocks, "swap-out")
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs])
        for pools, swaps in ((self.k, self.swap_k), (self.v, self.swap_v)):
            for pool, swap in zip(pools, swaps):
                if pool.shape[0] == self.num_blocks:
                    swap.index_copy_(0, dst, pool.index_select(0, src).to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (host block, device block) pairs host -> device."""
        if not pairs:
            return
        self._check(pairs, self.num_host_blocks, self.num_blocks, "swap-in")
        src = torch.tensor([p[0] for p in pairs])
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for pools, swaps in ((self.k, self.swap_k), (self.v, self.swap_v)):
            for pool, swap in zip(pools, swaps):
                if pool.shape[0] == self.num_blocks:
                    pool.index_copy_(0, dst, swap.index_select(0, src).to(self.device,
                                                                          non_blocking=True))
