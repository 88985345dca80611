"""The one knob schema: every setting of the engine, the server and `iterserve generate`.

Each config below is a dataclass of knobs in vLLM's style (load, scheduler, KV cache,
parallel, kernels, observability; the server and the OpenAI frontend; the generate
command), and each knob is one field whose metadata (`Knob`, core/knobs.py) holds its help,
type, bounds, choices and flag. Everything else is derived from these fields, so adding a
knob is one declaration:

- `validate()` checks every field against its metadata, then the rules between fields;
- `EngineArgs` (engine/args.py) has one field per knob of `ENGINE_CONFIGS`, with the same
  default, and builds the configs by field name;
- the flags of `iterserve serve` (`ENGINE_CONFIGS` + `SERVER_CONFIGS`) and `iterserve
  generate` (`ENGINE_CONFIGS` + `GenerateConfig`) are generated from it
  (`add_config_arguments`), with vLLM's spellings;
- the lab's options (lab/options.py) are a pydantic model whose scheduler and KV-cache
  fields are made from the same metadata, with the engine's defaults except where
  lab/options.py `LAB_DEFAULTS` says why not.

Defaults that depend on the device are declared with `per_device` on the knob (the field
holds the CPU's); `knobs.default_on` is the one function that picks. A knob that is
accepted without effect (`no_effect`) or refused (`refused`) is declared the same way:
`knob_notices` gives the start-up line of the first, validation refuses the second.

The one cross-knob rule, kept in one place: without chunked prefill a whole
prompt must fit in one step, so the token budget must cover max_model_len. As in vLLM, a
budget that was not given (None) is raised to max_model_len; an explicit one that is too
small is a ConfigError naming the knob.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Mapping

from iterserve.core.knobs import (  # noqa: F401  (the schema's vocabulary, re-exported)
    Knob, PerDevice, add_config_arguments, add_knob_argument, default_of, default_on, device_type,
    flag_of, human_readable_int, json_arg, knob, knob_fields, knobs_of, per_device)
from iterserve.errors import ConfigError



class SchedulingPolicy(enum.StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"
    SLO = "slo"            # core/slo_policy.py: admit by TTFT / TPOT targets


class Batching(enum.StrEnum):
    CONTINUOUS = "continuous"
    STATIC = "static"


class PreemptionMode(enum.StrEnum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


class RouterPolicy(enum.StrEnum):
    """How requests are spread over data-parallel replicas (core/router.py)."""
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX_AWARE = "prefix_aware"


def check_knob(name: str, value: Any, k: Knob) -> Any:
    """`value` checked (and coerced: str -> Enum, int -> float) against `k`; ConfigError
    naming the knob otherwise."""
    if value is None:
        if k.nullable:
            return None
        raise ConfigError(f"{name} must be set", name)
    if k.repeat or k.nargs:
        if k.nargs and isinstance(value, str):
            value = [value]                       # one of several (LLM(served_model_name="m"))
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list, got {value!r}", name)
        if k.nargs == "+" and not value:
            raise ConfigError(f"{name} needs at least one value", name)
        one = dataclasses.replace(k, repeat=False, nargs=None, nullable=False)
        return [check_knob(name, v, one) for v in value]
    if k.kind in (dict, list):                    # a JSON-valued flag
        what = "object" if k.kind is dict else "array"
        if isinstance(value, str):                # JSON text (LLM(speculative_config="{...}"))
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{name} must be a JSON {what}: {e.msg} at character "
                                  f"{e.pos}", name) from None
        if not isinstance(value, k.kind):
            raise ConfigError(f"{name} must be a JSON {'object' if k.kind is dict else 'array'}"
                              f", got {value!r}", name)
        return value
    if isinstance(k.kind, type) and issubclass(k.kind, enum.Enum):
        try:
            return k.kind(value)
        except ValueError:
            raise ConfigError(
                f"{name} must be one of {', '.join(k.choices)}; got {value!r}", name) from None
    if k.kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}", name)
        return value
    if k.kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}", name)
        if k.choices and value not in k.choices:
            raise ConfigError(
                f"{name} must be one of {', '.join(k.choices)}; got {value!r}", name)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}", name)
    if k.kind is int:
        if not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer, got {value!r}", name)
    else:
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value!r}", name)
        value = float(value)
    lo, hi = k.minimum, k.maximum
    if lo is not None and (value < lo or (k.exclusive_minimum and value == lo)):
        raise ConfigError(f"{name} must be {'greater than' if k.exclusive_minimum else 'at least'}"
                          f" {lo:g}, got {value:g}", name)
    if hi is not None and value > hi:
        raise ConfigError(f"{name} must be at most {hi:g}, got {value:g}", name)
    return value


def _is_set(value: Any, default: Any) -> bool:
    return value is not None and value != default


def _check_fields(obj: Any) -> None:
    """Every knob of a config checked (and coerced) in place; a refused knob that is set
    is a ConfigError naming its flag."""
    for name, default, k in knob_fields(type(obj)):
        value = check_knob(name, getattr(obj, name), k)
        if k.refused is not None and _is_set(value, default):
            raise ConfigError(f"{flag_of(name, k)}: {k.refused}", name)
        setattr(obj, name, value)


def knob_notices(*configs: Any) -> list[str]:
    """One line per knob that is set but has no effect here (`no_effect`), for the log at
    start; `configs` are config objects or EngineArgs (whose fields carry the same Knobs)."""
    lines = []
    for obj in configs:
        for name, default, k in knob_fields(type(obj)):
            if k.no_effect is not None and _is_set(getattr(obj, name), default):
                lines.append(f"{flag_of(name, k)} has no effect here: {k.no_effect}")
    return lines


def config_from(cls: type, values: Mapping[str, Any]) -> Any:
    """A config built from the values of its knobs' names (e.g. an argparse namespace's
    vars; missing names keep their defaults), validated."""
    names = {name for name, _, _ in knob_fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names}).validate()


@dataclass(slots=True)
class LoadConfig:
    """What to load and how (vLLM's ModelConfig / LoadConfig / DeviceConfig flags)."""

    TITLE: ClassVar[str] = "model"
    model: str | None = knob(
        None, "HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)",
        str, nullable=True)
    served_model_name: list[str] | None = knob(
        None, "the model's name(s) for clients: responses carry the first, a request's "
        "`model` may be any of them and /v1/models lists them all", str, nargs="+",
        metavar="NAME", derived="default: derived from --model")
    tokenizer: str | None = knob(
        None, "a tokenizer other than the model's: an HF tokenizer directory, a "
        "tokenizer.json file or a .gguf file", str, metavar="PATH",
        derived="default: the model's own")
    dtype: str = knob(
        "auto", "compute dtype; auto keeps the weights as the checkpoint stores them and "
        "computes in float32 on CPU", str,
        choices=("auto", "float32", "float", "bfloat16", "float16", "half"))
    device: str = knob("cpu", "torch device", str)
    seed: int = knob(0, "torch seed for unseeded sampling", int)
    # --- what the model is served as (vLLM's --runner / --convert / --task) ---------------
    runner: str = knob(
        "auto", "what the model is served as (vLLM's): generate (text generation: the "
        "completions, chat, responses and messages endpoints) or pooling (an embedding "
        "model: /v1/embeddings, /v1/score, /rerank); auto: pooling for a checkpoint whose "
        "architecture is a bare *Model (e.g. Qwen3Model), else generate", str,
        choices=("auto", "generate", "pooling", "draft"))
    convert: str = knob(
        "auto", "vLLM: what a pooling runner makes of the model; embed serves a decoder as an "
        "embedding model (pooling as its sentence-transformers config says, else the last "
        "token normalised); auto / none: the model as it is", str,
        choices=("auto", "none", "embed", "classify", "reward", "mm_encoder_only"))
    task: str | None = knob(
        None, "vLLM's older spelling of --runner / --convert: generate, or embed / embedding "
        "(--runner pooling --convert embed)", str,
        nullable=True, choices=("auto", "generate", "embed", "embedding", "classify", "score",
                                "reward", "transcription", "draft"))
    pooler_config: dict | None = knob(
        None, "with --runner pooling, how to pool, as JSON (vLLM's keys): pooling_type "
        "(LAST, MEAN, CLS, MAX, MEAN_SQRT_LEN), normalize (true / false); overrides the "
        "checkpoint's sentence-transformers config", dict, nullable=True,
        parse=json_arg(dict), metavar="JSON")
    hf_overrides: dict | None = knob(
        None, "keys set over the model's config.json before it is read, as JSON (vLLM's; e.g. "
        "'{\"is_matryoshka\": true}' for an embedding model trained for truncated dimensions)",
        dict, nullable=True, parse=json_arg(dict), metavar="JSON")
    # --- vLLM load flags: honoured where they mean something here, else said why -----------
    tokenizer_mode: str = knob(
        "auto", "auto / hf: the model's tokenizer.json through HF's `tokenizers` (iterserve's "
        "one tokenizer implementation); slow, mistral and custom are not available", str,
        choices=("auto", "hf", "slow", "mistral", "custom"))
    load_format: str = knob(
        "auto", "the weights' format: auto (a directory's safetensors or a .gguf file), "
        "safetensors or gguf (checked against the model path)", str,
        choices=("auto", "pt", "safetensors", "npcache", "dummy", "tensorizer",
                 "sharded_state", "gguf", "bitsandbytes", "mistral", "runai_streamer",
                 "runai_streamer_sharded", "fastsafetensors"))
    quantization: str | None = knob(
        None, "the weights' quantization: gguf (GGUF block types, read as they are stored; a "
        ".gguf model needs no flag) or none; vLLM's other methods (awq, gptq, fp8, ...) are "
        "refused", str, nullable=True, aliases=("-q",), metavar="METHOD")
    trust_remote_code: bool = knob(
        False, "vLLM: allow a checkpoint's own Python code to run", bool,
        no_effect="iterserve runs its own implementation of the architectures it serves "
        "(llama, mistral, qwen2, qwen3, gpt2) and never imports a checkpoint's Python files, "
        "so there is no remote code to run")
    download_dir: str | None = knob(
        None, "vLLM: where to download weights from the Hugging Face Hub", str, nullable=True,
        metavar="DIR", no_effect="iterserve serves a local model directory or .gguf file and "
        "downloads nothing")
    revision: str | None = knob(
        None, "vLLM: the Hub revision (branch, tag or commit) to download", str, nullable=True,
        no_effect="iterserve serves the local files at the model path, so there is no "
        "revision to pick")
    code_revision: str | None = knob(
        None, "vLLM: the Hub revision of the model's code", str, nullable=True,
        no_effect="no model code is downloaded or run (see --trust-remote-code)")
    tokenizer_revision: str | None = knob(
        None, "vLLM: the Hub revision of the tokenizer", str, nullable=True,
        no_effect="the tokenizer is read from the local model path (or --tokenizer)")
    max_parallel_loading_workers: int | None = knob(
        None, "vLLM: load the weights in sequential batches of N workers", int, minimum=1,
        nullable=True, metavar="N", no_effect="the weights are memory-mapped and used where "
        "they lie in the file: no worker reads them, so there is nothing to bound")
    enforce_eager: bool = knob(
        False, "always eager here: iterserve runs PyTorch ops and its own C kernels, and "
        "captures no CUDA graph and compiles nothing, so the flag asks for what it does", bool)
    max_logprobs: int = knob(
        20, "most logprobs a request may ask for (logprobs, top_logprobs, prompt_logprobs); "
        "-1: the vocabulary size", int, minimum=-1)
    logprobs_mode: str = knob(
        "raw_logprobs", "what logprobs report: raw_logprobs, the log-softmax of the model's "
        "logits before penalties, temperature and truncation (the only mode here)", str,
        choices=("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"))
    structured_outputs_config: dict | None = knob(
        None, "structured outputs, as JSON (vLLM's keys): backend (auto, guidance: "
        "llguidance, the one engine here), disable_any_whitespace, disable_additional_properties",
        dict, nullable=True, parse=json_arg(dict), metavar="JSON")

    STRUCTURED_BACKENDS: ClassVar[tuple[str, ...]] = (
        "auto", "guidance", "xgrammar", "outlines", "lm-format-enforcer")

    def validate(self) -> "LoadConfig":
        _check_fields(self)
        self._check_model_kind()
        self._check_load_flags()
        self._check_structured_outputs()
        return self

    def _check_model_kind(self) -> None:
        """Text generation and embedding (pooling) models are served: a classification,
        reward or draft model is refused before anything loads, saying so."""
        if self.runner == "draft" or self.task == "draft":
            raise ConfigError("--runner draft: a draft model serves speculative decoding, "
                              "which is not implemented yet; iterserve serves the model "
                              "itself (--runner generate)", "runner")
        other = (f"--convert {self.convert}" if self.convert in ("classify", "reward",
                                                                  "mm_encoder_only") else
                 f"--task {self.task}" if self.task in ("classify", "score", "reward",
                                                        "transcription") else None)
        if other is not None:
            raise ConfigError(
                f"{other}: classification, reward and transcription models are not served "
                "yet (no classifier head); iterserve serves text generation (--runner "
                "generate) and embeddings (--runner pooling / --convert embed)",
                "task" if other.startswith("--task") else "convert")
        if self.runner == "generate" and (self.convert == "embed"
                                          or self.task in ("embed", "embedding")):
            raise ConfigError("--runner generate with --convert embed / --task embed: an "
                              "embedding model is served by the pooling runner (--runner "
                              "pooling)", "runner")
        if self.pooler_config is not None:
            unknown = sorted(set(self.pooler_config) - {"pooling_type", "normalize"})
            if unknown:
                raise ConfigError(f"--pooler-config: unknown or unsupported key(s) "
                                  f"{', '.join(unknown)} (served here: pooling_type, "
                                  "normalize)", "pooler_config")

    def pooling(self, architectures: Iterable[str] = ()) -> bool:
        """Whether the model is served as an embedding model: --runner pooling, --convert
        embed or --task embed; under auto, a checkpoint whose architectures are bare
        `*Model`s (a base model without an LM head, as sentence-transformers saves it),
        vLLM's rule."""
        if self.runner == "pooling" or self.convert == "embed" \
                or self.task in ("embed", "embedding"):
            return True
        if self.runner == "generate" or self.task == "generate":
            return False
        archs = list(architectures)
        return bool(archs) and all(a.endswith("Model") and not a.endswith("LMHeadModel")
                                   for a in archs)

    def _check_load_flags(self) -> None:
        if self.tokenizer_mode not in ("auto", "hf"):
            raise ConfigError(
                f"--tokenizer-mode {self.tokenizer_mode}: not available; iterserve reads the "
                "model's tokenizer.json (or the GGUF's vocabulary) with HF's `tokenizers` "
                "library (--tokenizer-mode auto / hf)", "tokenizer_mode")
        if self.load_format not in ("auto", "safetensors", "gguf"):
            raise ConfigError(
                f"--load-format {self.load_format}: not available; iterserve reads safetensors "
                "directories and .gguf files (--load-format auto, safetensors or gguf)",
                "load_format")
        q = self.quantization
        if q is not None and q.lower() == "none":
            self.quantization = q = None
        if q is not None and q != "gguf":
            raise ConfigError(
                f"--quantization {q}: not supported; iterserve runs GGUF block-quantised "
                "weights (Q4_0 ... Q8_0, the K-quants, IQ4) as stored, and float safetensors; "
                "convert the model to GGUF (llama.cpp's convert_hf_to_gguf.py, then "
                "llama-quantize) and serve the .gguf file", "quantization")
        if self.logprobs_mode != "raw_logprobs":
            raise ConfigError(
                f"--logprobs-mode {self.logprobs_mode}: not available; logprobs here are "
                "raw_logprobs (the log-softmax of the model's logits before penalties, "
                "temperature and truncation)", "logprobs_mode")

    def _check_structured_outputs(self) -> None:
        so = self.structured_outputs_config
        if so is None:
            return
        known = {"backend", "disable_fallback", "disable_any_whitespace",
                 "disable_additional_properties", "reasoning_parser", "enable_in_reasoning"}
        extra = sorted(set(so) - known)
        if extra:
            raise ConfigError(f"--structured-outputs-config: unknown key(s) {', '.join(extra)} "
                              f"(vLLM's keys: {', '.join(sorted(known))})",
                              "structured_outputs_config")
        backend = so.get("backend", "auto")
        if backend not in self.STRUCTURED_BACKENDS:
            raise ConfigError(f"--structured-outputs-config: backend {backend!r} is not one of "
                              f"{', '.join(self.STRUCTURED_BACKENDS)}",
                              "structured_outputs_config")
        for key in ("disable_fallback", "disable_any_whitespace",
                    "disable_additional_properties", "enable_in_reasoning"):
            if key in so and not isinstance(so[key], bool):
                raise ConfigError(f"--structured-outputs-config: {key} must be true or false",
                                  "structured_outputs_config")
        if so.get("reasoning_parser") or so.get("enable_in_reasoning"):
            raise ConfigError("--structured-outputs-config: reasoning_parser / "
                              "enable_in_reasoning need a reasoning parser, which this "
                              "configuration does not have", "structured_outputs_config")

    def structured_outputs_notices(self) -> list[str]:
        """The start-up line for a structured-outputs backend this server cannot switch to."""
        so = self.structured_outputs_config or {}
        backend = so.get("backend", "auto")
        lines = []
        if backend not in ("auto", "guidance"):
            lines.append(f"--structured-outputs-config backend {backend!r} is not available: "
                         "structured outputs run on llguidance here (vLLM's 'guidance' "
                         "backend), which enforces the same JSON schema, regex, choice and "
                         "grammar constraints")
        if so.get("disable_fallback"):
            lines.append("--structured-outputs-config disable_fallback has no effect here: "
                         "there is one backend, so nothing falls back")
        return lines


@dataclass(slots=True)
class CacheConfig:
    """The paged KV pool. The scheduler and the block manager read the block counts; the
    memory budgets are how EngineArgs sizes them once the model's bytes per block are
    known (so a core user gives num_kv_blocks itself)."""

    TITLE: ClassVar[str] = "KV cache"
    block_size: int = knob(16, "tokens per KV block", int, minimum=1)
    num_kv_blocks: int | None = knob(
        None, "device KV blocks", int, minimum=1,
        derived="default: as many as fit in --kv-cache-memory; overrides it")
    num_swap_blocks: int = knob(
        0, "host KV blocks for preemption by swap", int, minimum=0,
        derived="default: from --swap-space; with --preemption-mode swap and no swap space, "
                "as many as the device pool; overrides --swap-space")
    enable_prefix_caching: bool = knob(True, "share the KV blocks of common prompt prefixes",
                                       bool)
    kv_cache_memory: float = knob(1.0, "GiB for the KV cache", float, minimum=0,
                                  exclusive_minimum=True, metavar="GiB")
    kv_cache_dtype: str = knob(
        "auto", "KV cache dtype: auto is the compute dtype (float32 on CPU); float16 / "
        "bfloat16 halve KV memory", str, choices=("auto", "float32", "float16", "bfloat16"))
    swap_space: float | None = knob(
        None, "GiB of host memory for swapped-out KV blocks", float, minimum=0,
        nullable=True, metavar="GiB")
    # The KV tiers below the pool (core/kv_tiers.py, model/kv_tier_store.py): engine/args.py
    # turns the directory and the GiB into the two block counts the core reads.
    kv_offload_dir: str | None = knob(
        None, "a disk tier for the prefix cache: every cached block is written to DIR and "
        "read back when a prompt needs it again, also after a restart (default: none). "
        "Blocks are keyed by the model file, dtypes and block size; replicas and restarts "
        "share DIR", str, nullable=True, metavar="DIR")
    kv_offload_gib: float = knob(
        8.0, "with --kv-offload-dir: GiB of block files kept, least recently used evicted "
        "first (per replica)", float, minimum=0, exclusive_minimum=True, metavar="GiB")
    kv_offload_ram_gib: float | None = knob(
        None, "host RAM that keeps cached blocks the KV pool evicts, and where disk reads "
        "land", float, minimum=0, metavar="GiB",
        derived="default: on a GPU the pool's size up to 4 GiB; on the CPU none, or with "
                "--kv-offload-dir a quarter of the pool, at least two max_model_len prompts")
    num_ram_tier_blocks: int = knob(
        0, "host RAM slots that keep cached blocks the pool evicts", int, minimum=0,
        derived="default: from --kv-offload-ram-gib; overrides it")
    num_disk_tier_blocks: int = knob(
        0, "blocks the disk tier may hold (one file each)", int, minimum=0,
        derived="default: from --kv-offload-gib with --kv-offload-dir; overrides it")
    kv_cache_memory_bytes: int | None = knob(
        None, "bytes for the KV cache, vLLM's spelling ('8G' = 8 GiB, '8g' = 8e9 bytes); "
        "overrides --kv-cache-memory and --gpu-memory-utilization", int, minimum=1,
        nullable=True, parse=human_readable_int, metavar="BYTES")
    gpu_memory_utilization: float | None = knob(
        None, "on a CUDA device, the share of the GPU's memory this process may use; the KV "
        "cache gets what the weights and a step's activations leave of it (vLLM's meaning; "
        "no effect on CPU, where --kv-cache-memory sizes the cache)", float, minimum=0,
        exclusive_minimum=True, maximum=1, nullable=True,
        derived="default: unset, --kv-cache-memory sizes the cache")
    prefix_caching_hash_algo: str | None = knob(
        None, "vLLM: the hash that keys prefix-cache blocks", str, nullable=True,
        choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "builtin"),
        no_effect="the prefix cache keys a block by its parent and its own token ids and "
        "compares the tokens on every hit, so no hash collision can serve another prompt's KV "
        "and the hash function is not a choice that matters")

    def validate(self) -> "CacheConfig":
        _check_fields(self)
        if self.num_kv_blocks is None:
            raise ConfigError("num_kv_blocks must be set (EngineArgs sizes it from "
                              "kv_cache_memory once the model is loaded)", "num_kv_blocks")
        if (self.num_ram_tier_blocks or self.num_disk_tier_blocks) \
                and not self.enable_prefix_caching:
            raise ConfigError("the KV tiers keep prefix-cache blocks: they need "
                              "enable_prefix_caching", "num_ram_tier_blocks")
        if self.num_disk_tier_blocks and not self.num_ram_tier_blocks:
            raise ConfigError("the disk tier is read back through RAM tier slots: "
                              "num_disk_tier_blocks needs num_ram_tier_blocks",
                              "num_ram_tier_blocks")
        return self


@dataclass(slots=True)
class SchedulerConfig:
    TITLE: ClassVar[str] = "scheduler"
    # The CPU defaults suit a small model on a CPU, where a step's cost grows with its token
    # count (a prefill chunk adds about 1.2 ms per token to everyone's step on a laptop-class
    # core): 32 decodes still cost a few tens of ms, and a 256-token budget caps the stall a
    # long prompt's chunk causes. A GPU step costs about the same from 1 to a few thousand
    # tokens, so there the defaults are vLLM's for its OpenAI server.
    max_num_seqs: int = knob(per_device(32, cuda=256), "sequences per step", int, minimum=1)
    max_num_batched_tokens: int | None = knob(
        None, "token budget per step", int, minimum=1,
        device_default=per_device(256, cuda=2048),
        derived="without chunked prefill, at least max_model_len")
    max_model_len: int = knob(2048, "prompt + output tokens per request", int, minimum=2,
                              derived="default: the model's limit, at most 2048")
    enable_chunked_prefill: bool = knob(True, "split long prompts over several steps", bool)
    long_prefill_token_threshold: int = knob(
        0, "cap on one request's prefill chunk (0: none)", int, minimum=0)
    max_num_partial_prefills: int = knob(1, "prompts mid-prefill at once", int, minimum=1)
    max_long_partial_prefills: int | None = knob(
        None, "of the prompts mid-prefill, how many may be long (more than "
        "long_prefill_token_threshold tokens left); a long prompt over the cap is passed over "
        "for shorter ones behind it (vLLM's, whose default is 1; applies when "
        "max_num_partial_prefills > 1)", int, minimum=1, nullable=True)
    max_long_prefill_tokens: int = knob(
        0, "tokens per step that long prompts (more than long_prefill_token_threshold "
        "tokens) may take in all, so the step that ends one long prefill and starts the "
        "next is no longer than the others: one long chunk's worth per step, whatever "
        "the budget leaves (0: no cap)", int, minimum=0)
    scheduling_policy: SchedulingPolicy = knob(
        SchedulingPolicy.FCFS, "queue order (priority: lower value first, may preempt)",
        SchedulingPolicy)
    batching: Batching = knob(Batching.CONTINUOUS,
                              "continuous, or static (a whole batch runs to completion)", Batching)
    preemption_mode: PreemptionMode = knob(
        PreemptionMode.RECOMPUTE, "what happens to a request evicted for KV room", PreemptionMode)
    max_queued_requests: int = knob(
        0, "bound on the waiting queue; beyond it requests get 503 (0: none)", int, minimum=0)
    request_timeout: float | None = knob(
        None, "seconds from arrival after which a request ends with finish_reason 'timeout'",
        float, minimum=0, exclusive_minimum=True, nullable=True)
    queue_timeout: float | None = knob(
        None, "seconds a request may wait before admission", float, minimum=0,
        exclusive_minimum=True, nullable=True)
    # --- scheduling_policy "priority": short steps while an urgent class is active -----
    priority_less_urgent_tokens: int = knob(
        0, "scheduling_policy priority: while a more urgent request runs, waits or was seen "
        "in the last priority_guard_steps steps, less urgent requests get at most this many "
        "tokens per step in all, so the step in flight when an urgent request arrives is "
        "short (0: no cap)", int, minimum=0)
    priority_guard_steps: int = knob(
        500, "scheduling_policy priority: steps an urgent class stays active after its last "
        "request was seen (for priority_less_urgent_tokens)", int, minimum=0)
    # --- scheduling_policy "slo" (core/slo_policy.py) -----------------------------------
    slo_ttft_ms: float | None = knob(
        None, "scheduling_policy slo: default time-to-first-token target (ms); a request "
        "that cannot meet it is refused early (429 + Retry-After)", float, minimum=0,
        exclusive_minimum=True, nullable=True)
    slo_tpot_ms: float | None = knob(
        None, "scheduling_policy slo: default time-per-output-token target (ms); admission "
        "holds before one more decode would break it", float, minimum=0,
        exclusive_minimum=True, nullable=True)
    slo_cost_model: str | None = knob(
        None, "scheduling_policy slo: the cost model its online step-time model starts "
        "from (a JSON file or a shipped name; default smollm2-cpu)", str, nullable=True,
        metavar="FILE|NAME")
    async_scheduling: bool = knob(
        False, "vLLM: schedule the next step while the current one runs", bool,
        no_effect="each step is scheduled when the previous step's tokens are back (they "
        "decide what the next step computes); there is no asynchronous scheduler to turn on")
    # --- speculative decoding (core/spec_decode) ----------------------------------------
    speculative_config: dict | None = knob(
        None, "speculative decoding, vLLM's JSON: {\"method\": \"ngram\" | \"suffix\" | "
        "\"draft_model\" | \"synthetic\", \"num_speculative_tokens\": K, "
        "\"prompt_lookup_min\"/\"prompt_lookup_max\": N (ngram), \"model\": PATH "
        "(draft_model), \"acceptance_rates\": [P0, ...] (synthetic), \"adaptive\": true "
        "(drafts per request follow its acceptance and the batch size: off where they "
        "would be a loss)}; greedy output stays that of speculation off (default: off)",
        dict, nullable=True, metavar="JSON")

    def validate(self, default_max_num_batched_tokens: int | None = None) -> "SchedulerConfig":
        """Check every knob, then resolve the budget (None: `default_max_num_batched_tokens`,
        else the knob's CPU default, raised to max_model_len without chunked prefill).
        Idempotent."""
        _check_fields(self)
        if (self.max_long_partial_prefills is not None
                and self.max_long_partial_prefills > self.max_num_partial_prefills):
            raise ConfigError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})",
                "max_long_partial_prefills")
        if (self.max_long_partial_prefills is not None and not self.long_prefill_token_threshold
                and self.max_long_partial_prefills < self.max_num_partial_prefills):
            # vLLM then makes "long" 4% of the context and caps every chunk there; here the
            # chunk cap stays what the user set, so the threshold must be given.
            raise ConfigError(
                "max_long_partial_prefills needs long_prefill_token_threshold (the prompt "
                "length above which a prefill counts as long)", "max_long_partial_prefills")
        if self.speculative_config is not None:
            # (core/spec_decode imports this module: a circle at import time)
            from iterserve.core.spec_decode.config import (
                SpeculativeConfig, SpeculativeConfigError)
            try:
                spec = SpeculativeConfig.parse(self.speculative_config)
            except SpeculativeConfigError as e:
                where = f".{e.key}" if e.key else ""
                raise ConfigError(f"speculative_config{where}: {e}",
                                  "speculative_config") from None
            self.speculative_config = spec.to_dict() if spec is not None else None
        if self.max_long_prefill_tokens and not self.long_prefill_token_threshold:
            raise ConfigError(
                "max_long_prefill_tokens needs long_prefill_token_threshold (the prompt "
                "length above which a prefill counts as long)", "max_long_prefill_tokens")
        if self.max_num_batched_tokens is None:
            budget = default_max_num_batched_tokens
            if budget is None:
                budget = default_on(_SCHEDULER_KNOBS["max_num_batched_tokens"], None)
            if not self.enable_chunked_prefill:
                budget = max(budget, self.max_model_len)
            self.max_num_batched_tokens = budget
        elif not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) without chunked prefill, or a long "
                "prompt could never be scheduled; raise it, leave it unset or turn chunked "
                "prefill on", "max_num_batched_tokens")
        return self


class KernelActivations(enum.StrEnum):
    """How the CPU decode kernels treat activations (model/kernels/qdot8.c)."""
    AUTO = "auto"      # the measured default: int8 up to per-type row counts (qdot8.c)
    FLOAT = "float"    # float32 activations: equal to a float GEMM up to summation order
    INT8 = "int8"      # rows quantised to 8 bits, integer dot products (llama.cpp's scheme)


class OmpWaitPolicy(enum.StrEnum):
    """What idle OpenMP threads of the CPU kernels do between parallel regions
    (engine/omp_policy.py applies it before torch loads libgomp)."""
    ENV = "env"          # leave OMP_WAIT_POLICY as the environment has it (libgomp's default)
    AUTO = "auto"        # passive when the CPUs are busy at start or quota-limited, else env
    ACTIVE = "active"    # spin: the fastest hand-off between regions on an idle machine
    PASSIVE = "passive"  # sleep: no spinning thread takes a core another process needs


_SCHEDULER_KNOBS = {name: k for name, _, k in knob_fields(SchedulerConfig)}
DEFAULT_MAX_NUM_BATCHED_TOKENS = default_on(_SCHEDULER_KNOBS["max_num_batched_tokens"], None)


@dataclass(slots=True)
class KernelConfig:
    """How the model's native CPU kernels compute, set when the model loads."""

    TITLE: ClassVar[str] = "kernels"

    kernel_activations: KernelActivations = knob(
        KernelActivations.AUTO, "GEMM activations over GGUF weights: int8 (quantised rows, integer dot "
        "products, as llama.cpp; about 0.5 percent relative error per output), float (float32, equal to "
        "a float GEMM up to summation order) or auto (int8 where it measured faster: decode "
        "K-quants up to 32 rows, Q4_0/Q4_1/Q5_0/Q5_1 up to 32 on AVX-512 VBMI CPUs, else 8, "
        "Q8_0 up to 8; prefill chunks of more than 32 rows of these types; bf16 dot products "
        "for BF16 weights, and F16 from 16 rows, on avx512bf16 CPUs; the LM head stays float, "
        "which cut the divergence from float by 30 percent for about 4 percent of a batch-1 "
        "step)", KernelActivations)
    batch_invariant: bool = knob(
        False, "compute every linear output in one order whatever else the step holds (a "
        "sequence's logits then do not depend on its batch; the linear kernels cost 1.2-3.7x "
        "at decode row counts)", bool)
    omp_wait_policy: OmpWaitPolicy = knob(
        OmpWaitPolicy.ENV, "idle OpenMP threads: env (as OMP_WAIT_POLICY says, libgomp "
        "spins by default), active, passive (sleep: on a machine whose cores other "
        "processes use, spinning threads made a decode step 10-100x slower), or auto "
        "(passive when the 1-minute load average at start is at least the usable CPUs, or "
        "under a cgroup CPU quota); "
        "applied by `iterserve serve` before torch loads, an OMP_WAIT_POLICY in the "
        "environment wins", OmpWaitPolicy)
    threads: int | None = knob(
        None, "compute threads of a step (the OpenMP team of the kernels and torch); default: "
        "adaptive, at most the usable CPUs (affinity mask, cgroup CPU quota), fewer while "
        "measured step times say other processes take cores (model/contention.py)", int,
        minimum=1, nullable=True)

    def validate(self) -> "KernelConfig":
        _check_fields(self)
        return self


@dataclass(slots=True)
class ParallelConfig:
    """How one served model is spread over processes. Data parallel: N whole
    engine replicas behind one endpoint (Ray Serve), a request goes to one of them by
    `router`. Tensor parallel: one engine whose weights are split over N ranks
    (torch.distributed), the scheduler on rank 0."""

    TITLE: ClassVar[str] = "parallel"
    data_parallel_size: int = knob(1, "engine replicas behind the one endpoint (Ray Serve)",
                                   int, minimum=1, aliases=("-dp",))
    tensor_parallel_size: int = knob(1, "ranks one model's weights are split over "
                                     "(torch.distributed)", int, minimum=1, aliases=("-tp",))
    pipeline_parallel_size: int = knob(
        1, "vLLM: stages a model's layers are split over", int, minimum=1, aliases=("-pp",),
        refused="pipeline parallelism is not implemented; iterserve splits one model over "
        "processes by tensor parallelism (--tensor-parallel-size / -tp N) and serves "
        "replicas with --data-parallel-size")
    router: RouterPolicy = knob(RouterPolicy.LEAST_LOADED,
                                "how requests are spread over replicas", RouterPolicy)
    threads_per_replica: int | None = knob(
        None, "OpenMP threads of each replica or rank (default: the cores / replicas)", int,
        minimum=1, nullable=True)
    ray_address: str | None = knob(
        None, "with --data-parallel-size > 1: join this Ray cluster ('auto', 'HOST:PORT') "
        "instead of starting a local one", str, nullable=True, metavar="ADDRESS")

    def validate(self) -> "ParallelConfig":
        _check_fields(self)
        return self


@dataclass(slots=True)
class ObservabilityConfig:
    """What the engine keeps for the trace endpoint and the live view (engine/tracing.py)."""

    TITLE: ClassVar[str] = "observability"
    max_finished_requests: int = knob(
        1000, "finished requests whose traces /v1/requests/{id}/trace keeps", int, minimum=0)
    step_history_len: int = knob(
        300, "engine steps (those that did something) the live view keeps", int, minimum=0)
    disable_log_stats: bool = knob(
        False, "`iterserve serve` logs throughput, running / waiting requests and KV use "
        "every 10 s while it works (vLLM's stats line); this turns it off", bool)

    def validate(self) -> "ObservabilityConfig":
        _check_fields(self)
        return self


_NO_LORA = ("LoRA adapters are not supported yet; iterserve serves one model's own weights "
            "(merge the adapter into them, e.g. with peft's merge_and_unload(), and serve the "
            "merged model)")


@dataclass(slots=True)
class LoRAConfig:
    """vLLM's LoRA flags: refused, each naming what it needs (there are no adapters yet)."""

    TITLE: ClassVar[str] = "LoRA (vLLM's flags; not supported yet)"
    enable_lora: bool = knob(False, "vLLM: serve LoRA adapters", bool, refused=_NO_LORA)
    max_loras: int | None = knob(None, "vLLM: adapters in one batch", int, nullable=True,
                                 refused=_NO_LORA)
    max_lora_rank: int | None = knob(None, "vLLM: the largest adapter rank", int,
                                     nullable=True, refused=_NO_LORA)
    max_cpu_loras: int | None = knob(None, "vLLM: adapters kept in host memory", int,
                                     nullable=True, refused=_NO_LORA)
    fully_sharded_loras: bool = knob(False, "vLLM: shard adapters over tensor-parallel ranks",
                                     bool, refused=_NO_LORA)
    lora_dtype: str | None = knob(None, "vLLM: the adapters' dtype", str, nullable=True,
                                  refused=_NO_LORA)

    def validate(self) -> "LoRAConfig":
        _check_fields(self)
        return self


_TEXT_ONLY = ("iterserve serves text-only models; images, audio and video need a multimodal "
              "model, which it does not run")


@dataclass(slots=True)
class MultiModalConfig:
    """vLLM's multimodal flags. A limit of 0 per modality (how vLLM runs a vision model as
    text-only) is the truth here and is accepted; anything that asks for media is refused."""

    TITLE: ClassVar[str] = "multimodal (vLLM's flags; text-only here)"
    limit_mm_per_prompt: dict | None = knob(
        None, "vLLM: media items per prompt, as JSON; only zeros ('{\"image\": 0}') are "
        "possible here", dict, nullable=True, parse=json_arg(dict), metavar="JSON")
    mm_processor_kwargs: dict | None = knob(
        None, "vLLM: options of the multimodal processor", dict, nullable=True,
        parse=json_arg(dict), metavar="JSON", refused=_TEXT_ONLY)
    allowed_local_media_path: str | None = knob(
        None, "vLLM: a directory requests may read media from", str, nullable=True,
        refused=_TEXT_ONLY)
    media_io_kwargs: dict | None = knob(
        None, "vLLM: options of the media loaders", dict, nullable=True,
        parse=json_arg(dict), metavar="JSON", refused=_TEXT_ONLY)
    mm_processor_cache_gb: float | None = knob(
        None, "vLLM: GiB for cached multimodal inputs", float, minimum=0, nullable=True,
        no_effect="there are no multimodal inputs to cache (text-only models)")
    skip_mm_profiling: bool = knob(
        False, "vLLM: skip profiling the multimodal encoder", bool,
        no_effect="there is no multimodal encoder (text-only models)")

    def validate(self) -> "MultiModalConfig":
        _check_fields(self)
        for modality, limit in (self.limit_mm_per_prompt or {}).items():
            count = limit.get("count", 0) if isinstance(limit, dict) else limit
            if count != 0:
                raise ConfigError(f"--limit-mm-per-prompt {modality}={count}: {_TEXT_ONLY} "
                                  f"(a limit of 0 is accepted)", "limit_mm_per_prompt")
        return self


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(slots=True)
class ServerConfig:
    """`iterserve serve`'s HTTP server (server/cli.py, server/app.py)."""

    TITLE: ClassVar[str] = "server"
    host: str = knob("127.0.0.1", "address to listen on", str)
    port: int = knob(8000, "port to listen on", int, minimum=0, maximum=65535)
    api_key: str | None = knob(
        None, "require 'Authorization: Bearer <key>' on every route but /health, /ping and "
        "the lab page", str, nullable=True)
    metrics_require_auth: bool = knob(
        False, "with --api-key, /metrics needs the key too (off: Prometheus scrapers usually "
        "send none)", bool)
    max_request_body_bytes: int = knob(
        4 << 20, "larger bodies get 413 (4 MiB)", int, minimum=1)
    shutdown_timeout: float = knob(
        5.0, "seconds in-flight requests may run on after SIGINT/SIGTERM; then they end with "
        "finish_reason 'abort' and the process exits within about one more second", float,
        minimum=0)
    debug_check_consistency: bool = knob(
        False, "check the scheduler's books after every step (they are always checked when "
        "the engine goes idle)", bool)
    log_level: str = knob("info", "log level", str, choices=LOG_LEVELS)
    # --- vLLM's HTTP flags (server/http_options.py) ----------------------------------------
    uds: str | None = knob(
        None, "listen on this Unix domain socket instead of --host / --port", str,
        nullable=True, metavar="PATH")
    ssl_keyfile: str | None = knob(None, "HTTPS: the private key file (PEM)", str,
                                   nullable=True, metavar="FILE")
    ssl_certfile: str | None = knob(None, "HTTPS: the certificate file (PEM)", str,
                                    nullable=True, metavar="FILE")
    ssl_ca_certs: str | None = knob(
        None, "HTTPS: CA certificates that client certificates are checked against", str,
        nullable=True, metavar="FILE")
    ssl_cert_reqs: int = knob(
        0, "HTTPS: whether a client certificate is required (Python's ssl.CERT_NONE 0, "
        "CERT_OPTIONAL 1, CERT_REQUIRED 2)", int, minimum=0, maximum=2)
    allowed_origins: list | None = knob(
        None, "CORS: origins whose browser pages may call the API, as a JSON list "
        "('[\"http://localhost:3000\"]', '[\"*\"]'); unset: no cross-origin access (vLLM "
        "allows every origin by default)", list, nullable=True, parse=json_arg(list),
        metavar="JSON")
    allowed_methods: list | None = knob(
        None, "CORS: allowed methods, a JSON list (default with --allowed-origins: all)", list,
        nullable=True, parse=json_arg(list), metavar="JSON")
    allowed_headers: list | None = knob(
        None, "CORS: allowed request headers, a JSON list (default with --allowed-origins: "
        "all)", list, nullable=True, parse=json_arg(list), metavar="JSON")
    allow_credentials: bool = knob(False, "CORS: allow credentials (cookies, authorization)",
                                   bool)
    root_path: str | None = knob(
        None, "the path prefix a reverse proxy serves this app under ('/llm'): requests "
        "under it are routed as without it, and the OpenAPI schema names it", str,
        nullable=True, metavar="PATH")
    disable_uvicorn_access_log: bool = knob(False, "no uvicorn access-log line per request",
                                            bool)
    disable_fastapi_docs: bool = knob(
        False, "no /docs, /redoc and /openapi.json (404)", bool)
    enable_request_id_headers: bool = knob(
        False, "every response carries X-Request-Id (the request's own, else a new one)", bool)

    def validate(self) -> "ServerConfig":
        _check_fields(self)
        if self.metrics_require_auth and not self.api_key:
            raise ConfigError("--metrics-require-auth needs --api-key", "metrics_require_auth")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ConfigError("HTTPS needs both --ssl-keyfile and --ssl-certfile",
                              "ssl_keyfile" if self.ssl_keyfile is None else "ssl_certfile")
        if (self.ssl_ca_certs or self.ssl_cert_reqs) and self.ssl_certfile is None:
            raise ConfigError("--ssl-ca-certs / --ssl-cert-reqs need --ssl-keyfile and "
                              "--ssl-certfile", "ssl_ca_certs")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"--{name.replace('_', '-')} {path}: no such file", name)
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if value is not None and not all(isinstance(v, str) for v in value):
                raise ConfigError(f"--{name.replace('_', '-')} must be a JSON list of strings",
                                  name)
        if self.root_path is not None:
            if not self.root_path.startswith("/"):
                raise ConfigError(f"--root-path {self.root_path!r} must start with '/'",
                                  "root_path")
            self.root_path = self.root_path.rstrip("/") or None
        return self


@dataclass(slots=True)
class FrontendConfig:
    """The OpenAI endpoints' server-wide settings, vLLM's flags (server/serving_config.py
    says what each does), so a pasted `vllm serve MODEL ...` command line works."""

    TITLE: ClassVar[str] = "OpenAI frontend (vLLM's flags)"
    chat_template: str | None = knob(
        None, "a Jinja chat template (a file, or the template itself) used instead of the "
        "model's", str, nullable=True, metavar="FILE|STRING")
    trust_request_chat_template: bool = knob(
        False, "accept a request's own chat_template (off: such requests get a 400; a "
        "template is a program the server runs)", bool)
    enable_auto_tool_choice: bool = knob(
        False, 'let the model decide when to call tools (tool_choice "auto"); needs '
        "--tool-call-parser", bool)
    tool_call_parser: str | None = knob(
        None, "how the model writes tool calls: hermes (Qwen2.5/3, Hermes, SmolLM3), "
        "llama3_json (Llama 3.x), mistral, openai (gpt-oss's harmony calls); also the format "
        'forced for tool_choice "required" / named (default hermes)', str, nullable=True,
        choices=("hermes", "llama3_json", "mistral", "openai"))  # = iterserve.tools.TOOL_PARSERS
    generation_config: str = knob(
        "auto", "auto: the model's generation_config.json supplies default temperature / "
        "top_p / top_k / min_p / repetition_penalty / max_tokens for requests that leave "
        "them unset; vllm: ignore it; DIR: read DIR/generation_config.json", str,
        metavar="auto|vllm|DIR")
    uvicorn_log_level: str | None = knob(
        None, "uvicorn's own log level", str, choices=(*LOG_LEVELS, "trace"),
        derived="default: --log-level")
    enable_log_requests: bool = knob(
        False, "log each request's prompt and sampling params (--disable-log-requests: do "
        "not, the default as in current vLLM)", bool, off_aliases=("--disable-log-requests",))
    max_log_len: int | None = knob(
        None, "with --enable-log-requests: at most N prompt characters and token ids per "
        "logged request (default: all)", int, minimum=0, nullable=True, metavar="N")
    chat_template_content_format: str = knob(
        "auto", "how a message's content reaches the chat template: string (its text), "
        "openai (a list of {\"type\": \"text\", \"text\": ...} parts), auto (openai when "
        "the template loops over a message's content, else string)", str,
        choices=("auto", "string", "openai"))
    default_chat_template_kwargs: dict | None = knob(
        None, "chat template variables for every request, as JSON "
        "('{\"enable_thinking\": false}'); a request's chat_template_kwargs win", dict,
        nullable=True, parse=json_arg(dict), metavar="JSON")
    response_role: str = knob(
        "assistant", "the role chat replies carry (when the prompt ends with the generation "
        "prompt; otherwise the last message's role)", str)
    exclude_tools_when_tool_choice_none: bool = knob(
        False, 'with tool_choice "none", the tools are not shown to the chat template (by '
        "default they are, as vLLM does)", bool)
    override_generation_config: dict | None = knob(
        None, "default sampling values over --generation-config's, as JSON "
        "('{\"temperature\": 0.5}'; temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens)", dict, nullable=True, parse=json_arg(dict), metavar="JSON")
    enable_prompt_tokens_details: bool = knob(
        False, "usage carries prompt_tokens_details.cached_tokens (the prompt tokens served "
        "from the prefix cache)", bool)
    enable_force_include_usage: bool = knob(
        False, "every stream ends with its usage chunk, as if it asked for "
        "stream_options.include_usage", bool)
    reasoning_parser: str | None = knob(
        None, "split the model's thinking into message.reasoning_content: deepseek_r1 "
        "(output starts thinking, up to </think>), qwen3 (<think>...</think> when the output "
        "opens with it), openai_gptoss (gpt-oss's analysis channel); structured outputs and "
        "forced tool calls then apply to the answer only", str, nullable=True, metavar="NAME",
        choices=("deepseek_r1", "openai_gptoss", "qwen3"))  # = iterserve.reasoning.REASONING_PARSERS
    lora_modules: list | None = knob(
        None, "vLLM: LoRA adapters to serve (name=path)", str, nullable=True, nargs="+",
        refused=_NO_LORA)

    def validate(self) -> "FrontendConfig":
        _check_fields(self)
        if self.response_role == "":
            raise ConfigError("--response-role must not be empty", "response_role")
        return self


@dataclass(slots=True)
class GenerateConfig:
    """`iterserve generate`'s own flags: how to sample and print (engine/cli.py). Greedy
    and 64 tokens (the API's defaults are temperature 1 and 16 tokens) make a quick,
    repeatable look at a model from the shell."""

    TITLE: ClassVar[str] = "generation"
    chat: bool = knob(False, "wrap each prompt as a user message", bool)
    max_tokens: int = knob(64, "tokens to generate per prompt", int)
    temperature: float = knob(0.0, "sampling temperature (0: greedy)", float)
    top_p: float = knob(1.0, "nucleus sampling mass", float)
    top_k: int = knob(0, "sample from the k most likely tokens (0: all)", int)
    n: int = knob(1, "completions per prompt", int)
    stop: str | None = knob(None, "stop string (repeatable)", str, nullable=True, repeat=True)
    sampling_seed: int | None = knob(None, "per-request sampling seed", int, nullable=True)
    ignore_eos: bool = knob(False, "keep generating past the end-of-sequence token", bool)
    json: bool = knob(False, "print one JSON object per completion", bool)
    progress: bool = knob(True, "show a progress bar", bool)

    def validate(self) -> "GenerateConfig":
        _check_fields(self)         # types only: SamplingParams.validate() checks the values
        return self


# The configs EngineArgs is made of (engine/args.py), and the server's own.
ENGINE_CONFIGS: tuple[type, ...] = (LoadConfig, SchedulerConfig, CacheConfig, ParallelConfig,
                                    KernelConfig, ObservabilityConfig, LoRAConfig,
                                    MultiModalConfig)
SERVER_CONFIGS: tuple[type, ...] = (ServerConfig, FrontendConfig)
ALL_CONFIGS: tuple[type, ...] = ENGINE_CONFIGS + SERVER_CONFIGS + (GenerateConfig,)


def schema() -> dict[str, tuple[Any, Knob, type]]:
    """Every knob of the product: name -> (default, Knob, config class)."""
    return knobs_of(*ALL_CONFIGS)
