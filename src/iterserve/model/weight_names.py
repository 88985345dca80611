"""Each family's tensor names -> the decoder's (model/llama.py), without reading a byte.

Both loaders speak HF names (the GGUF loader translates llama.cpp's at its border), and the
families name the same things differently; this module maps them once, so the decoder's
`load_weights` has one set of names to know:

- the "model." prefix goes; a multimodal Gemma 3 checkpoint's text tensors lose their
  language-model prefix and its vision tower is left out (iterserve serves the text model);
- Gemma's norms by role: HF's `post_attention_layernorm` is the norm on the attention
  output (`post_attn_norm` here), `pre_feedforward_layernorm` the norm before the MLP
  (`post_attention_layernorm`, Llama's name for that role), `post_feedforward_layernorm` the
  norm on the MLP output (`post_ffn_norm`);
- Phi-3's fused `qkv_proj` / `gate_up_proj` become q/k/v and gate/up: row slices of the one
  tensor (adjacent in the file, so the decoder's fused GEMM is still one zero-copy view, and
  tensor parallel splits them like any other q/k/v);
- experts: Mixtral's `block_sparse_moe.{gate, experts.N.w1/w3/w2}` and Qwen3-MoE's
  `mlp.gate` become `mlp.router` and `mlp.experts.N.{gate,up,down}_proj`.

`expert_refs` gives one expert's parts in whichever form the file holds them: per-expert
tensors (HF), rows of stacked [experts, rows, k] tensors (GGUF; row slices, no copy), or
gpt-oss's HF tensors (a float [experts, in, out] layout transposed once at load, or MXFP4
blocks + scales repacked into GGML's MXFP4 blocks, model/mxfp4.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from iterserve.errors import ModelLoadError
from iterserve.model.config import ModelConfig
from iterserve.model.weights import (FLOAT_TYPES, SUPPORTED_TYPES, EncodedWeight, TensorRef,
                                     _adjacent, type_name)

_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
_SKIP = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector|vision_model|embed_vision)\.")
_GEMMA_NORMS = {"post_attention_layernorm": "post_attn_norm",
                "pre_feedforward_layernorm": "post_attention_layernorm",
                "post_feedforward_layernorm": "post_ffn_norm"}
_LAYER = re.compile(r"^(layers\.\d+\.)(.+)$")
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def row_slice(ref: TensorRef, r0: int, r1: int, shape: tuple[int, ...] | None = None) -> TensorRef:
    """Rows [r0, r1) of `ref` (its leading dimensions flattened) as a reference into the same
    file bytes, still in the file's encoding; adjacent slices stay adjacent (file_map kept),
    so stacking them again is a zero-copy view."""
    if ref.row_perm is not None:
        raise ModelLoadError(f"{ref.name}: cannot take rows of a row-permuted tensor")
    rb = ref.row_bytes
    shape = shape or (r1 - r0, ref.k)
    return TensorRef(ref.name, ref.ggml_type, shape, ref.path, ref.offset + r0 * rb,
                     (r1 - r0) * rb, ref.mapping[r0 * rb:r1 * rb], file_map=ref.file_map)


@dataclass(eq=False)
class MadeRef(TensorRef):
    """A tensor made at load from file tensors (a transposed or repacked expert): `made`
    holds its bytes (uint8 [rows, row_bytes]); counted by the memory plan as copied."""

    made: torch.Tensor | None = None

    def view(self) -> torch.Tensor:
        return self.made

    def read_into(self, out: torch.Tensor) -> None:
        out.view(self.rows, self.row_bytes).copy_(self.made)


def made_ref(name: str, ggml_type: int, shape: tuple[int, int], data: torch.Tensor) -> MadeRef:
    data = data.contiguous().view(torch.uint8).view(shape[0], -1)
    return MadeRef(name, ggml_type, tuple(shape), "", 0, data.numel(), data.view(-1),
                   made=data)


def canonical_refs(refs: dict[str, TensorRef], c: ModelConfig) -> dict[str, TensorRef]:
    out: dict[str, TensorRef] = {}
    for name, ref in refs.items():
        if _SKIP.match(name):
            continue
        for pre in _PREFIXES:
            if name.startswith(pre):
                name = name[len(pre):]
                break
        m = _LAYER.match(name)
        if m is None:
            out[name] = ref
            continue
        p, rest = m.groups()
        head, _, tail = rest.partition(".weight")
        if c.sandwich_norms and head in _GEMMA_NORMS and tail == "":
            out[p + _GEMMA_NORMS[head] + ".weight"] = ref
        elif rest in ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"):
            _split_fused(out, p, rest, ref, c)
        elif rest.startswith("block_sparse_moe."):
            rest = rest[len("block_sparse_moe."):]
            e = re.match(r"^experts\.(\d+)\.(w[123])\.(weight|bias)$", rest)
            if e:
                out[f"{p}mlp.experts.{e[1]}.{_MIXTRAL[e[2]]}.{e[3]}"] = ref
            else:
                out[p + "mlp." + rest.replace("gate.", "router.", 1)] = ref
        elif rest.startswith("mlp.gate.") and c.is_moe(int(p.split(".")[1])):
            out[p + "mlp.router." + rest[len("mlp.gate."):]] = ref
        else:
            out[name] = ref
    return out


def _split_fused(out: dict, p: str, rest: str, ref: TensorRef, c: ModelConfig) -> None:
    if rest.startswith("self_attn"):
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv}
        base = p + "self_attn."
    else:
        inter = ref.rows // 2
        sizes = {"gate_proj": inter, "up_proj": inter}
        base = p + "mlp."
    if ref.rows != sum(sizes.values()):
        raise ModelLoadError(f"{p}{rest} has {ref.rows} rows, the config implies "
                             f"{sum(sizes.values())}")
    r = 0
    for part, n in sizes.items():
        out[f"{base}{part}.weight"] = row_slice(ref, r, r + n)
        r += n


def expert_refs(refs: dict, p: str, e: int, c: ModelConfig, take) -> dict:
    """One expert's parts: {"gate_up": [refs stacked as rows], "down": [ref],
    "gate_up_bias": [refs], "down_bias": [refs], "interleaved": bool}. `p` is
    "layers.{i}.mlp."; `take` marks a tensor used (and raises for a missing one)."""
    E, inter, hidden = c.num_experts, c.moe_intermediate_size, c.hidden_size
    one = f"{p}experts.{e}."
    out = {"interleaved": False, "gate_up_bias": [], "down_bias": []}
    if one + "gate_proj.weight" in refs:                       # per-expert tensors (HF)
        out["gate_up"] = [take(one + "gate_proj.weight"), take(one + "up_proj.weight")]
        out["down"] = [take(one + "down_proj.weight")]
        if c.expert_bias:
            out["gate_up_bias"] = [take(one + "gate_proj.bias"), take(one + "up_proj.bias")]
            out["down_bias"] = [take(one + "down_proj.bias")]
        return out
    stacked = f"{p}experts."
    if stacked + "gate_proj.weight" in refs:                   # [E, rows, k] (GGUF)
        for key, names, rows in (("gate_up", ("gate_proj", "up_proj"), inter),
                                 ("down", ("down_proj",), hidden)):
            parts = []
            for n in names:
                ref = take(f"{stacked}{n}.weight")
                if tuple(ref.shape) != (E, rows, ref.k):
                    raise ModelLoadError(f"{stacked}{n}.weight has shape {tuple(ref.shape)}, "
                                         f"the config implies ({E}, {rows}, k)")
                parts.append(row_slice(ref, e * rows, (e + 1) * rows))
            out[key] = parts
            if c.expert_bias:
                out[f"{key}_bias"] = [_bias_row(take(f"{stacked}{n}.bias"), e, rows)
                                      for n in names]
        return out
    if c.expert_act == "swiglu_oai" and (stacked + "gate_up_proj" in refs
                                         or stacked + "gate_up_proj_blocks" in refs):
        return _gpt_oss_expert(refs, stacked, e, c, take, out)
    if stacked + "gate_up_proj" in refs:        # transformers' fused [E, 2I, k] / [E, H, I]
        for key, name, rows in (("gate_up", "gate_up_proj", 2 * inter),
                                ("down", "down_proj", hidden)):
            ref = take(stacked + name)
            if len(ref.shape) != 3 or tuple(ref.shape[:2]) != (E, rows):
                raise ModelLoadError(f"{ref.name} has shape {tuple(ref.shape)}, the config "
                                     f"implies ({E}, {rows}, k)")
            out[key] = [row_slice(ref, e * rows, (e + 1) * rows)]
        return out
    raise ModelLoadError(f"weights lack the experts of {p[:-len('mlp.')]}"
                         f"(no {one}gate_proj.weight or {stacked}gate_proj.weight)")


def _bias_row(ref: TensorRef, e: int, n: int) -> TensorRef:
    if len(ref.shape) != 2 or ref.shape[1] != n:
        raise ModelLoadError(f"{ref.name} has shape {tuple(ref.shape)}, not [experts, {n}]")
    return row_slice(ref, e, e + 1, shape=(n,))


def _gpt_oss_expert(refs, stacked, e, c, take, out) -> dict:
    """gpt-oss's HF expert tensors: gate and up rows interleaved (gate = even rows)."""
    from iterserve.model import mxfp4
    inter, hidden = c.moe_intermediate_size, c.hidden_size
    out["interleaved"] = True
    if stacked + "gate_up_proj_blocks" in refs:                # MXFP4 blocks + E8M0 scales
        for key, name, rows, k in (("gate_up", "gate_up_proj", 2 * inter, hidden),
                                   ("down", "down_proj", hidden, inter)):
            blocks, scales = take(f"{stacked}{name}_blocks"), take(f"{stacked}{name}_scales")
            data = mxfp4.from_hf_blocks(_expert_view(blocks, e), _expert_view(scales, e))
            out[key] = [made_ref(f"{stacked}{name}[{e}]", mxfp4.MXFP4, (rows, k), data)]
    else:                                                      # float [E, in, out]
        for key, name, rows in (("gate_up", "gate_up_proj", 2 * inter),
                                ("down", "down_proj", hidden)):
            ref = take(stacked + name)
            if ref.ggml_type not in FLOAT_TYPES:
                raise ModelLoadError(f"{ref.name}: a float expert tensor of type {ref.ggml_type}")
            w = _expert_view(ref, e).view(FLOAT_TYPES[ref.ggml_type])
            w = w.view(-1, rows).t()                           # [out, in], copied below
            out[key] = [made_ref(f"{ref.name}[{e}]", ref.ggml_type, tuple(w.shape), w)]
    for key, name, rows in (("gate_up_bias", "gate_up_proj_bias", 2 * inter),
                            ("down_bias", "down_proj_bias", hidden)):
        out[key] = [_bias_row(take(stacked + name), e, rows)]
    return out


def _expert_view(ref: TensorRef, e: int) -> torch.Tensor:
    """The bytes of expert e of a [E, ...] tensor (a view of the mapping)."""
    E = ref.shape[0]
    per = ref.nbytes // E
    return ref.mapping[e * per:(e + 1) * per]


def stacked_views(parts: list[TensorRef]) -> EncodedWeight:
    """The parts stacked by rows with nothing copied: each run of parts that are neighbours
    in the file (one type) is one view of the mapping, any other part a segment of its own."""
    for r in parts:
        if r.ggml_type not in SUPPORTED_TYPES:
            raise ValueError(f"tensor {r.name!r} has type {type_name(r.ggml_type)}, which is "
                             "not supported")
    segments: list[tuple[int, torch.Tensor]] = []
    run: list[TensorRef] = []

    def flush():
        if not run:
            return
        if len(run) == 1:
            segments.append((run[0].ggml_type, run[0].view()))
        else:
            lo, hi = run[0].offset, run[-1].offset + run[-1].nbytes
            segments.append((run[0].ggml_type, torch.from_numpy(
                run[0].file_map[lo:hi]).view(-1, run[0].row_bytes)))
        run.clear()

    for r in parts:
        if run and not _adjacent(run[-1], r):
            flush()
        run.append(r)
    flush()
    return EncodedWeight(segments, parts[0].k, tuple(r.name for r in parts))
