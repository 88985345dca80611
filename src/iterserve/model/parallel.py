"""Tensor parallel: one rank's slice of a Llama-family model, and the collectives it needs.

Megatron's split (what vLLM and SGLang do), over torch.distributed's default group:

- column parallel (output rows split): q/k/v and gate/up. Rank r keeps heads
  [r*H/N, (r+1)*H/N) of q and [r*KV/N, ...) of k and v, and rows [r*I/N, ...) of gate and up.
  A GGUF row is whole blocks, so a row range is a byte range of the file: the slice stays in
  the file's encoding (a `weights.TensorRef` whose offset and length are the slice's), and
  llama's Q/K un-permutation, which only reorders rows inside a head, stays a row gather.
- row parallel (input dimension K split): o and down. Each encoded row is a sequence of
  blocks, so a K slice is the same byte range of every row (`KShardRef`: a [rows, K/N]
  weight still in the file's encoding, copied once into the rank's memory). Each rank's
  partial product is summed across the ranks in rank order (`ordered_all_reduce`), so the
  sum does not depend on the step's size. When K/N is not a multiple of the type's block
  size (Q4_K's 256 with a 128-wide slice) that tensor is split by output rows instead (a
  byte range of the file) and its input gathered (`RowParallelLinear`): each rank computes
  its rows with the whole K, in the file's encoding, as one process does.
- vocabulary parallel: the embedding and the LM head keep rows [r*ceil(V/N), ...) of the
  vocabulary. An embedding lookup of an id outside the slice gives zeros and the all-reduce
  adds the one rank that has it (exact); the LM head's slices of the logits are gathered on
  rank 0, the only rank that samples.

The model is the ordinary `LlamaForCausalLM` built from a per-rank config (heads and
intermediate size divided by N, `shard_config`) with four modules replaced (`prepare_model`):
the Linear / Embedding subclasses below, so the native kernels, packing and the reference
tiles run on the slices unchanged. The fused one-call decode path (`kernels.DecodeLayers`)
runs every layer in C and cannot all-reduce between o and down, so under TP the per-op path
is used for every step (`prepare_model` turns it off).

Numerics against one process: each rank's slices compute the same dot products as the whole
matrices, except o and down, whose K sums are split into N partial sums added after; and
the activation quantisation of the int8 kernels is per 32 / 256 elements of K, which a
block-aligned K slice keeps. So TP = N differs from TP = 1 by summation order, unless a
kernel's choice depends on K: the int8 GEMM's row thresholds do (kernels/qdot8.c
`iterserve_act8_gemm8_takes`, K > 4096 for down_proj), so a rank's down_proj over K / N may
run the float kernels where one process runs int8 (or the reverse) for the same step. On a
two-layer Q4_0 model with FFN 8192 and 9-13-token prompts, first-token logprobs of TP = 2
differed from one process by 3.4e-3 under the default kernels and by 4.3e-6 with float
activations: the mode switch, amplified by depth, is the 1.7B shape's 0.06.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import types
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from iterserve.errors import ModelLoadError
from iterserve.model.config import ModelConfig
from iterserve.model.default_model import default_model_path
from iterserve.model.gguf import open_gguf
from iterserve.model.gguf_loader import read_gguf_config
from iterserve.model.hf_loader import read_hf_config
from iterserve.model.layers import LM_HEAD_AUTO_ACTIVATIONS, Embedding, Linear
from iterserve.model.weights import FLOAT_TYPES, TensorRef, type_name

log = logging.getLogger(__name__)

TP_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

# HF tensor name (without "model.") -> how it is split: "rows:q" / "rows:kv" / "rows:ffn" /
# "rows:vocab" (column parallel, output rows), "k" (row parallel, input dimension).
_SPLITS = [
    (re.compile(r"^(embed_tokens|lm_head)\.weight$"), "rows:vocab"),
    (re.compile(r"^layers\.\d+\.self_attn\.q_proj\.(weight|bias)$"), "rows:q"),
    (re.compile(r"^layers\.\d+\.self_attn\.[kv]_proj\.(weight|bias)$"), "rows:kv"),
    (re.compile(r"^layers\.\d+\.mlp\.(gate|up)_proj\.weight$"), "rows:ffn"),
    (re.compile(r"^layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight$"), "k"),
]


def vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [v0, v1) of the vocabulary rank `rank` holds (ceil split; the last may be short)."""
    per = -(-vocab_size // world)
    return min(vocab_size, rank * per), min(vocab_size, (rank + 1) * per)


@dataclass(frozen=True)
class Shard:
    """Which slice this process holds: rank `rank` of `world` (torch.distributed's default
    group once it is initialised; the loader needs only the numbers)."""

    rank: int
    world: int

    def check(self, config: ModelConfig) -> None:
        """Refuse, before any weight is read, a model that cannot be split over `world`."""
        n = self.world
        if config.model_type not in TP_ARCHITECTURES:
            raise ModelLoadError(f"tensor parallel supports the {', '.join(TP_ARCHITECTURES)} "
                                 f"architectures, not {config.model_type!r}")
        for what, value in (("num_attention_heads", config.num_heads),
                            ("num_key_value_heads", config.num_kv_heads),
                            ("intermediate_size", config.intermediate_size)):
            if value % n:
                raise ModelLoadError(
                    f"tensor_parallel_size {n} does not divide the model's {what} ({value}): "
                    f"each rank must hold whole heads; choose a size that divides it")
        if config.vocab_size < n:
            raise ModelLoadError(f"a vocabulary of {config.vocab_size} cannot be split over "
                                 f"{n} ranks")

    def config(self, config: ModelConfig) -> ModelConfig:
        """The per-rank config: heads and intermediate size divided by N (head_dim, hidden
        size and the vocabulary stay: the runner's logits are the full vocabulary)."""
        self.check(config)
        n = self.world
        return dataclasses.replace(config, num_heads=config.num_heads // n,
                                   num_kv_heads=config.num_kv_heads // n,
                                   intermediate_size=config.intermediate_size // n)

    def refs(self, refs: dict[str, TensorRef], full: ModelConfig) -> dict[str, TensorRef]:
        """This rank's slice of every tensor (replicated ones as they are); see the module
        docstring. `full` is the unsplit config."""
        self.check(full)
        out = {}
        r, n = self.rank, self.world
        d = full.head_dim
        rows_of = {"q": full.num_heads * d, "kv": full.num_kv_heads * d,
                   "ffn": full.intermediate_size, "vocab": full.vocab_size}
        for name, ref in refs.items():
            short = name[len("model."):] if name.startswith("model.") else name
            how = next((h for pat, h in _SPLITS if pat.match(short)), None)
            if how is None:
                out[name] = ref
            elif how == "k" and k_splits(ref, n):
                out[name] = k_shard(ref, r, n)
            elif how == "k":
                # K / N is not whole blocks (Q4_K's 256 at K/2 = 128): split the output rows
                # instead, in the file's encoding; RowParallelLinear gathers its input
                rows = ref.shape[0] // n
                log.info("tensor parallel: %s is %s (%d-weight blocks), whose K slice at "
                         "N = %d is not whole blocks: split by output rows (input gathered)",
                         name, type_name(ref.ggml_type),
                         GGML_QUANT_SIZES[GGMLQuantizationType(ref.ggml_type)][0], n)
                out[name] = row_shard(ref, rows * r, rows * (r + 1))
            else:
                total = rows_of[how[5:]]
                if how == "rows:vocab":
                    a, b = vocab_range(total, r, n)
                else:
                    a, b = total // n * r, total // n * (r + 1)
                if ref.shape[0] != total:
                    raise ModelLoadError(f"tensor {name!r} has {ref.shape[0]} rows, the "
                                         f"config implies {total}")
                out[name] = row_shard(ref, a, b)
        return out

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Replace the modules that communicate (on the meta device, before the weights are
        installed): o/down -> RowParallelLinear, embedding and LM head -> vocab slices."""
        c = model.config
        with torch.device("meta"):
            model.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size,
                                                        self.rank, self.world)
            model.lm_head = VocabParallelLMHead(c.hidden_size, c.vocab_size,
                                                self.rank, self.world)
            for layer in model.layers:
                a, mlp = layer.self_attn, layer.mlp
                a.o_proj = RowParallelLinear(a.o_proj.in_features, a.o_proj.out_features,
                                             self.world)
                mlp.down_proj = RowParallelLinear(mlp.down_proj.in_features,
                                                  mlp.down_proj.out_features, self.world)
        # DecodeLayers runs o and down of every layer inside one C call: no all-reduce fits.
        model.use_fused_decode = types.MethodType(_no_fused_decode, model)
        model.tensor_parallel = self
        return model


def check_model(path: str | None, world: int) -> None:
    """Refuse a model that cannot be split over `world` ranks from its config alone, before
    any rank process starts (load_model reports a path that is neither kind of model)."""
    from pathlib import Path

    if path is None:
        path = default_model_path()
    p = Path(path).expanduser()
    if p.is_dir():
        hf = read_hf_config(p)
    elif p.is_file() and p.suffix.lower() == ".gguf":
        hf = read_gguf_config(open_gguf(p))
    else:
        return
    Shard(0, world).check(ModelConfig.from_hf(hf))


def _no_fused_decode(self, on: bool = True) -> bool:
    """Tensor parallel: the fused decode layers cannot all-reduce mid-layer (module docstring)."""
    self._fused = None
    return False


# --- slices of tensor references -----------------------------------------------------------

def row_shard(ref: TensorRef, r0: int, r1: int) -> TensorRef:
    """Rows [r0, r1) of `ref` (a vector: elements [r0, r1)) as a TensorRef over the same file
    bytes, still in the file's encoding."""
    if len(ref.shape) == 1:
        if ref.ggml_type not in FLOAT_TYPES:
            raise ModelLoadError(f"cannot split the {type_name(ref.ggml_type)} vector "
                                 f"{ref.name!r}")
        elem = ref.nbytes // ref.shape[0]
        return TensorRef(ref.name, ref.ggml_type, (r1 - r0,), ref.path, ref.offset + r0 * elem,
                         (r1 - r0) * elem, ref.mapping[r0 * elem:r1 * elem])
    rb = ref.row_bytes
    sub = TensorRef(ref.name, ref.ggml_type, (r1 - r0, *ref.shape[1:]), ref.path,
                    ref.offset + r0 * rb, (r1 - r0) * rb, ref.mapping[r0 * rb:r1 * rb])
    if ref.row_perm is None:
        return sub
    perm = np.asarray(ref.row_perm[r0:r1])
    if perm.size and (perm.min() < r0 or perm.max() >= r1):
        # llama's Q/K permutation stays inside a head, and shards are whole heads
        raise ModelLoadError(f"{ref.name}: its row order crosses the tensor-parallel split")
    return sub.with_row_perm(perm - r0)


def k_splits(ref: TensorRef, world: int) -> bool:
    """Whether a rank's K slice of `ref` is whole blocks of its type (then it stays encoded
    and row parallel; else the tensor is split by output rows instead, `Shard.refs`)."""
    block, _ = GGML_QUANT_SIZES[GGMLQuantizationType(ref.ggml_type)]
    return ref.k % world == 0 and (ref.k // world) % block == 0


def k_shard(ref: TensorRef, rank: int, world: int) -> TensorRef:
    """Columns [rank*K/N, (rank+1)*K/N) of every row: a byte range of each encoded row
    (KShardRef). The slice must be whole blocks (`k_splits`)."""
    k = ref.k
    if k % world:
        raise ModelLoadError(f"{ref.name}: inner dimension {k} is not divisible by "
                             f"tensor_parallel_size {world}")
    part = k // world
    k0 = rank * part
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ref.ggml_type)]
    if part % block:
        raise ModelLoadError(f"{ref.name}: a rank's slice of its inner dimension ({part}) is "
                             f"not whole {type_name(ref.ggml_type)} blocks of {block}")
    b0, b1 = k0 // block * size, (k0 + part) // block * size
    return KShardRef(ref.name, ref.ggml_type, (ref.rows, part), ref.path, ref.offset,
                     ref.rows * (b1 - b0), ref.mapping, ref.row_perm, source=ref, b0=b0, b1=b1)


@dataclass(eq=False)
class KShardRef(TensorRef):
    """Bytes [b0, b1) of every row of `source`: a K slice in the file's encoding. It is not
    one byte range of the file, so view() copies it into the rank's memory (1/N of the
    weight); the file's pages it reads stay shared page cache."""

    source: TensorRef | None = None
    b0: int = 0
    b1: int = 0

    def view(self) -> torch.Tensor:
        src = self.source
        rows = src.mapping.view(src.rows, src.row_bytes)[:, self.b0:self.b1]
        if src.row_perm is not None:
            rows = rows[torch.from_numpy(np.asarray(src.row_perm))]
        return rows.contiguous()

    def read_into(self, out: torch.Tensor) -> None:
        out.view(self.rows, self.row_bytes).copy_(self.view())


# --- modules that communicate --------------------------------------------------------------

def _dist():
    import torch.distributed as dist
    return dist


def ordered_all_reduce(y: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's `y`, added in rank order (((y0 + y1) + y2) + ...), the same
    bits on every rank and for every element whatever the tensor's size.

    Why not a plain all_reduce beyond two ranks: gloo's ring splits the tensor into chunks by
    its size and sums each chunk starting at a different rank, so an element's order (and its
    rounding) changed with the step's row count, and a sequence's logits with the batch.
    With two ranks every order is y0 + y1 (addition commutes exactly), so the one-call
    all_reduce is kept there."""
    dist = _dist()
    world = dist.get_world_size()
    if world <= 2:
        dist.all_reduce(y)
        return y
    parts = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(parts, y)
    out = parts[0]
    for p in parts[1:]:
        out.add_(p)
    return out


def _all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` side by side along the last dimension, in rank order."""
    dist = _dist()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


class RowParallelLinear(Linear):
    """o_proj / down_proj under TP (no bias in the Llama family). Over a K slice (whole
    blocks): every rank's partial product is summed across the ranks in rank order
    (`ordered_all_reduce`). Over a slice of output rows (a type whose K slice is not whole
    blocks, `Shard.refs`): the ranks' inputs are gathered into the whole K (the heads / FFN
    rows in rank order, as one process has them), each rank computes its rows with the whole
    K, exactly as one process does, and the outputs are gathered. The second form replaced
    dequantising such a slice to float32, which ran the float kernels where one process runs
    int8 ones (a logprob gap of int8's size, not of summation order)."""

    def __init__(self, in_features: int, out_features: int, world: int = 1) -> None:
        super().__init__(in_features, out_features)
        self.world, self.gathered = world, False

    def set_weight(self, w) -> None:
        shape = tuple(w.shape)
        if self.world > 1 and shape == (self.out_features // self.world,
                                        self.in_features * self.world):
            self.gathered = True
            self.out_features, self.in_features = shape
        super().set_weight(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gathered:
            return _all_gather_last(super().forward(_all_gather_last(x)))
        y = super().forward(x)
        if not y.is_contiguous():
            y = y.contiguous()
        return ordered_all_reduce(y)


class VocabParallelEmbedding(Embedding):
    """Rows [v0, v1) of the token table; ids outside them give zero rows, and the all-reduce
    adds the one rank that holds each id (an exact sum: every other term is 0)."""

    def __init__(self, vocab_size: int, dim: int, rank: int, world: int) -> None:
        self.v0, self.v1 = vocab_range(vocab_size, rank, world)
        super().__init__(self.v1 - self.v0, dim)
        self.full_vocab_size = vocab_size

    def forward(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        mine = (ids >= self.v0) & (ids < self.v1)
        local = torch.where(mine, ids - self.v0, torch.zeros_like(ids))
        h = super().forward(local, dtype)
        h = h.masked_fill(~mine.unsqueeze(-1), 0).contiguous()
        _dist().all_reduce(h)
        return h


class VocabParallelLMHead(Linear):
    """Rows [v0, v1) of the LM head: each rank computes its slice of the logits and rank 0
    gathers them (the others get their own slice back, which nobody reads)."""

    def __init__(self, hidden: int, vocab_size: int, rank: int, world: int) -> None:
        self.v0, self.v1 = vocab_range(vocab_size, rank, world)
        super().__init__(hidden, self.v1 - self.v0, auto_activations=LM_HEAD_AUTO_ACTIVATIONS)
        self.full_vocab_size, self.rank, self.world = vocab_size, rank, world
        self.per_rank = -(-vocab_size // world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x)
        pad = self.per_rank - local.shape[-1]
        if pad:
            local = F.pad(local, (0, pad))
        local = local.contiguous()
        dist = _dist()
        if self.rank == 0:
            parts = [torch.empty_like(local) for _ in range(self.world)]
            dist.gather(local, parts, dst=0)
            return torch.cat(parts, dim=-1)[..., :self.full_vocab_size]
        dist.gather(local, None, dst=0)
        return local
