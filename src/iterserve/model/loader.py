"""load_model(): one entry point for the default model, an HF directory or a GGUF file.

Every source is turned into (HF config dict, HF-named state dict, Tokenizer) first, so one
architecture class and one weight-mapping function serve all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from iterserve.model.config import ModelConfig, ModelLoadError, parse_dtype
from iterserve.model.hf_loader import read_hf_config, read_hf_weights
from iterserve.model.gpt2 import GPT2ForCausalLM
from iterserve.model.llama import LlamaForCausalLM

ARCHITECTURES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM,
                 "qwen3": LlamaForCausalLM, "gpt2": GPT2ForCausalLM}


@dataclass
class LoadedModel:
    config: ModelConfig
    model: torch.nn.Module
    tokenizer: "Tokenizer"  # noqa: F821 - iterserve.model.tokenizer.Tokenizer
    name: str


def load_model(path: str | None = None, *, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load a model for serving.

    path None -> the bundled default GGUF; a directory -> HF layout; a *.gguf file -> GGUF.
    Raises ModelLoadError (a ValueError) for a missing path, unsupported architecture or dtype.
    """
    torch_dtype = parse_dtype(dtype)
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ModelLoadError(f"bad device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but this torch has no usable CUDA")
    if path is None:
        from iterserve.model.default_model import default_model_path
        path = default_model_path()
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path {str(p)!r} does not exist")
    quantized = None
    if p.is_dir():
        from iterserve.model.tokenizer import Tokenizer
        hf_config = read_hf_config(p)
        config = ModelConfig.from_hf(hf_config, torch_dtype)   # fail on the arch before reading weights
        state = read_hf_weights(p)
        tokenizer = Tokenizer.from_hf_dir(p)
        name = p.name
    elif p.suffix.lower() == ".gguf":
        from iterserve.model.gguf_loader import load_gguf
        quantized = {} if dev.type == "cpu" and torch_dtype == torch.float32 else None
        hf_config, state, tokenizer = load_gguf(p, dtype=torch.float32, quantized=quantized)
        config = ModelConfig.from_hf(hf_config, torch_dtype)
        name = p.stem
    else:
        raise ModelLoadError(f"{str(p)!r} is neither an HF model directory nor a .gguf file")
    if not config.eos_token_ids and getattr(tokenizer, "eos_token_ids", None):
        config.eos_token_ids = sorted(tokenizer.eos_token_ids)
    model = build_model(config, state, dev)
    if quantized and hasattr(model, "attach_quantized"):
        model.attach_quantized(quantized)
    return LoadedModel(config=config, model=model, tokenizer=tokenizer, name=name)


def build_model(config: ModelConfig, state: dict[str, torch.Tensor],
                device: torch.device | str = "cpu") -> torch.nn.Module:
    cls = ARCHITECTURES[config.model_type]
    with torch.device("meta"):
        model = cls(config)
    model = model.to_empty(device=device).to(config.dtype)
    if hasattr(model, "rotary"):
        model.rotary = type(model.rotary)(config).to(device)   # buffers are computed, not loaded
    model.tie_weights()                                        # to_empty unties shared weights
    model.load_hf_state_dict(state)
    return model.eval()
