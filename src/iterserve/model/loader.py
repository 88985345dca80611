"""load_model(): one entry point for the default model, an HF directory or a GGUF file.

Every source is turned into (HF config dict, HF-named `weights.TensorRef`s, Tokenizer) first,
so one architecture class and one weight-mapping function serve all of them. The tensors are
references into memory-mapped files; `Placement` decides what each becomes in the model:

- CPU, `--dtype auto` (the default, as in vLLM): every weight stays in its file's encoding
  (GGUF blocks, bf16 / fp16 / fp32 rows), fused by stacking rows; activations are float32.
- CPU with an explicit `--dtype`: float-typed weights (F32/F16/BF16) that differ from it are
  converted to dense tensors of that dtype (the user asked for it); block-quantised ones
  stay encoded (there is nothing to convert them to but floats).
- CUDA: dense tensors of the compute dtype on the device (no GPU kernels over GGUF blocks).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

import torch

from iterserve.errors import ModelLoadError
from iterserve.model.config import DECODER_FAMILIES, ModelConfig, parse_dtype, parse_kv_cache_dtype
from iterserve.model.default_model import default_model_path
from iterserve.model.gguf_loader import load_gguf
from iterserve.model.hf_loader import read_hf_config, read_hf_weights, weight_files
from iterserve.model.gpt2 import GPT2ForCausalLM
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.startup import phase
from iterserve.model.tokenizer import Tokenizer, load_tokenizer_for
from iterserve.model.weights import FLOAT_TYPES, EncodedWeight, TensorRef, release_read_scratch

log = logging.getLogger(__name__)

# Every decoder family is the one decoder (model/llama.py, switches from ModelConfig).
ARCHITECTURES = {**{t: LlamaForCausalLM for t in DECODER_FAMILIES}, "gpt2": GPT2ForCausalLM}


@dataclass
class LoadedModel:
    config: ModelConfig
    model: torch.nn.Module
    tokenizer: "Tokenizer"  # noqa: F821 - iterserve.model.tokenizer.Tokenizer
    name: str
    path: str | None = None
    file_bytes: int = 0          # bytes of the weight files (what the memory plan maps)
    refs: dict = field(default_factory=dict, repr=False)
    hf_config: dict = field(default_factory=dict, repr=False)   # config.json (+ overrides)
    pooling: bool = False        # served as an embedding model (--runner pooling)


@dataclass
class Placement:
    """What a tensor reference becomes in the model (see the module docstring)."""
    device: torch.device
    dtype: torch.dtype               # compute dtype (activations, norms, biases)
    cast: torch.dtype | None = None  # explicit --dtype: float-typed weights converted to it

    def vector(self, ref: TensorRef) -> torch.Tensor:
        return ref.to_float().to(self.dtype).to(self.device)

    def matrix(self, parts: list[TensorRef], copy: bool = True) -> "EncodedWeight | torch.Tensor":
        """The parts stacked by rows. copy=False (experts) never copies on CPU: parts that
        are not neighbours in the file stay segments of their own (one more GEMM call each)
        instead of being read into one buffer (EncodedWeight.fuse)."""
        if self.device.type != "cpu":
            return torch.cat([p.to_float().to(self.dtype) for p in parts]).to(self.device)
        if self.cast is not None and all(p.ggml_type in FLOAT_TYPES for p in parts) \
                and any(FLOAT_TYPES[p.ggml_type] != self.cast for p in parts):
            return torch.cat([p.view().view(FLOAT_TYPES[p.ggml_type]).to(self.cast)
                              .view(p.shape[-2:] if len(p.shape) > 1 else p.shape)
                              for p in parts])
        if copy:
            return EncodedWeight.fuse(parts)
        from iterserve.model.weight_names import stacked_views
        return stacked_views(parts)


def _checkpoint_float_dtype(refs: dict[str, TensorRef]) -> torch.dtype:
    """The float dtype most weight bytes are stored in (float32 for block-quantised files)."""
    by: dict[torch.dtype, int] = {}
    for r in refs.values():
        dt = FLOAT_TYPES.get(r.ggml_type, torch.float32)
        by[dt] = by.get(dt, 0) + r.nbytes
    return max(by, key=by.get) if by else torch.float32


def load_model(path: str | None = None, *, dtype: str = "auto", device: str = "cpu",
               kv_cache_dtype: str = "auto", shard=None,
               tokenizer: str | None = None, hf_overrides: dict | None = None,
               pooling: Any = False) -> LoadedModel:
    """Load a model for serving.

    path None -> the bundled default GGUF; a directory -> HF layout; a *.gguf file -> GGUF.
    dtype "auto" keeps the checkpoint's weights as stored and computes in float32 on CPU
    (the checkpoint's float dtype on CUDA); kv_cache_dtype "auto" is the compute dtype.
    Raises ModelLoadError (a ValueError) for a missing path, unsupported architecture or dtype.
    `shard` (model.parallel.Shard): load only this tensor-parallel rank's slice.
    `tokenizer` (vLLM's --tokenizer): a tokenizer directory / tokenizer.json / .gguf used
    instead of the model's own (checked against the model's vocabulary size).
    `hf_overrides` (vLLM's --hf-overrides): keys set over config.json before it is read.
    `pooling`: served as an embedding model (a bool, or a function of config.json's
    architectures: LoadConfig.pooling); such a checkpoint may lack an LM head (a base
    model as sentence-transformers saves it), which pooling never uses.
    """
    explicit = parse_dtype(dtype)            # None for "auto"
    kv_dtype = parse_kv_cache_dtype(kv_cache_dtype)
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ModelLoadError(f"bad device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but this torch has no usable CUDA")
    if path is None:
        path = default_model_path()
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path {str(p)!r} does not exist")
    if p.is_dir():
        with phase("metadata"):
            hf_config = read_hf_config(p)
            ModelConfig.from_hf(hf_config)             # fail on the arch before mapping weights
            refs = read_hf_weights(p)
        with phase("tokenizer"):
            own_tokenizer = Tokenizer.from_hf_dir(p) if tokenizer is None else None
        name = p.name
        file_bytes = sum(f.stat().st_size for f in weight_files(p))
    elif p.suffix.lower() == ".gguf":
        hf_config, refs, own_tokenizer = load_gguf(p, tokenizer=tokenizer is None)
        name = p.stem
        file_bytes = p.stat().st_size
    else:
        raise ModelLoadError(f"{str(p)!r} is neither an HF model directory nor a .gguf file")
    if explicit is not None:
        compute = explicit
    elif dev.type == "cpu":
        compute = torch.float32
    else:
        compute = _checkpoint_float_dtype(refs)
    if hf_overrides:
        hf_config = {**hf_config, **hf_overrides}
    if callable(pooling):
        pooling = pooling(hf_config.get("architectures") or ())
    pooling = bool(pooling)
    config = ModelConfig.from_hf(hf_config, compute)
    if pooling and not config.tie_word_embeddings and "lm_head.weight" not in refs:
        # No LM head to load: the head shares the embedding table, never called.
        config.tie_word_embeddings = True
    config.kv_cache_dtype = kv_dtype or compute
    if tokenizer is not None:                # --tokenizer (api's hunk)
        with phase("tokenizer"):
            own_tokenizer = load_tokenizer_for(tokenizer, config.vocab_size)
    tokenizer = own_tokenizer
    if not config.eos_token_ids and getattr(tokenizer, "eos_token_ids", None):
        config.eos_token_ids = sorted(tokenizer.eos_token_ids)
    if shard is not None:             # tensor parallel: this rank's slice (model/parallel.py)
        refs, config = shard.refs(refs, config), shard.config(config)
    with phase("weights"):
        model = build_model(config, refs, dev, cast=explicit,
                            prepare=None if shard is None else shard.prepare_model)
    return LoadedModel(config=config, model=model, tokenizer=tokenizer, name=name,
                       path=str(p), file_bytes=file_bytes, refs=refs, hf_config=hf_config,
                       pooling=pooling)


def build_model(config: ModelConfig, refs: dict[str, TensorRef],
                device: torch.device | str = "cpu", cast: torch.dtype | None = None,
                prepare=None) -> torch.nn.Module:
    device = torch.device(device)
    cls = ARCHITECTURES[config.model_type]
    with torch.device("meta"):
        model = cls(config)
    if prepare is not None:           # tensor parallel: swap in the modules that communicate
        model = prepare(model)
    if hasattr(model, "load_weights"):
        model.load_weights(refs, Placement(device, config.dtype, cast))
        release_read_scratch()
    else:
        # gpt2: HF stores its projections as Conv1D [in, out], transposed at load, so its
        # weights are dense float tensors (converted once from the mapped file).
        model = model.to_empty(device=device).to(config.dtype)
        model.tie_weights()                                    # to_empty unties shared weights
        model.load_hf_state_dict({n: r.to_float() for n, r in refs.items()})
    if hasattr(model, "make_rotary"):
        model.make_rotary(device)                 # buffers are computed, not loaded
    elif hasattr(model, "rotary"):
        model.rotary = type(model.rotary)(config).to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelLoadError(f"the {config.model_type} model has tensors no weight filled: "
                             f"{left[:5]}")
    return model.eval()
