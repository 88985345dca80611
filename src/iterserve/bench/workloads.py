"""Benchmark workloads: fixed-seed request lists that every engine receives identically.

Why text built from a word list: the client talks to servers with different tokenizer code
(iterserve, llama.cpp, vLLM, HF), so a prompt must have the same token count everywhere.
Every word in `WORDS` is a single token with a leading space (and `FIRST_WORDS` without one)
in SmolLM2's BPE vocabulary, and BPE never merges across a space, so a prompt of n words is
exactly n tokens (checked against the real tokenizer in tests/bench/test_workloads.py).
Requests carry `ignore_eos` semantics through `max_tokens`: every engine generates exactly
that many tokens, so throughput compares the same work.

Workloads (see `WORKLOADS`):
- ``mix``: 48 requests, 80% short answers (10-100 new tokens), 20% long (250-500), prompts of
  8-40 tokens, all arriving at t=0 (the lab's reference mix).
- ``poisson``: the same length mix arriving as a Poisson process at ``rate`` requests/s.
- ``longprompt``: a few 2,000-token prompts arriving among many short chats (Poisson), to show
  what chunked prefill does to everyone else's inter-token latency.
- ``sharegpt``: prompt/output lengths drawn from ``data/sharegpt_lengths.json`` (a documented,
  ShareGPT-like parametric distribution; see that file for its sources and caveats).
- ``agent``: multi-turn agent sessions (8 by default, 10 turns each) that share a 2,000-token
  system prompt with its tool list; every turn sends the whole conversation again plus about
  300 tokens of tool output and asks for a short answer. Sessions are closed loops: turn
  k + 1 is sent when turn k has answered (bench/sessions.py runs them). The conversation
  carries the workload's own answer text, not the model's, so every engine gets exactly the
  same prompts; the prefix an engine can reuse is the previous turn's prompt.
- ``edit``: an agent's edit turn: each prompt quotes a 300-800-token Python file and asks for
  it back with one function renamed, so the answer repeats the prompt (what speculative
  decoding from the context accepts). The files are made of `WORDS` identifiers, so every
  engine sees the same text; their token counts are estimates (code punctuation is not one
  token per character in every vocabulary), said in the workload's `extra`.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from importlib import resources

from iterserve.errors import WorkloadError


# Single tokens (with a leading space) in SmolLM2's tokenizer; common English, so they are
# single tokens in most BPE vocabularies too (GPT-2, Llama-3 style).
WORDS: tuple[str, ...] = tuple("""
the of and to in is was for on that with as by at from his her it an are this be or which
have had not one were but all they their more there been has after other when would into time
some only first new these two also about people world water light story music river city
garden house night morning friend family school book letter window mountain forest ocean
island village market station bridge machine engine paper stone cloud storm summer winter
spring autumn teacher doctor farmer artist writer singer king queen child mother father
brother sister table chair door road street field valley lake hill tree flower bird horse dog
cat fish apple bread coffee tea milk sugar salt fire wind rain snow sun moon star sky green
blue red white black small large old young long short happy quiet bright dark warm cold early
late simple strong gentle careful brave clever kind honest curious patient walk run read
write speak listen learn build open close carry find give keep make take watch wait travel
explain describe remember imagine compare""".split())
FIRST_WORDS: tuple[str, ...] = ("Tell", "Write")

DEFAULT_SEED = 0
DEFAULT_POISSON_RATE = 2.0   # requests/s when `poisson` is asked for without a rate


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload: what to send, how much to generate, and when."""

    index: int
    prompt: str
    prompt_len: int        # tokens in `prompt` (exact for SmolLM2's tokenizer)
    max_tokens: int        # tokens to generate (ignore_eos: exactly this many)
    arrival_s: float       # seconds after the benchmark starts
    kind: str              # "short" | "long" | "longprompt" | "chat" | "sharegpt" | "agent"
    #                        | "edit"
    session: int = -1      # agent: the session this turn belongs to (-1: no session)
    turn: int = 0          # agent: 1-based turn in its session (sent after turn - 1 answered)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    seed: int
    rate: float | None     # requests/s of the arrival process, None = all at t=0
    requests: tuple[BenchRequest, ...]
    description: str
    extra: dict = field(default_factory=dict)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def summary(self) -> dict:
        """JSON-ready description (goes into every result file)."""
        return {
            "name": self.name, "seed": self.seed, "rate": self.rate,
            "num_requests": len(self.requests),
            "total_prompt_tokens": self.total_prompt_tokens,
            "total_output_tokens": self.total_output_tokens,
            "description": self.description, **self.extra,
        }


def make_prompt(num_tokens: int, rng: random.Random) -> str:
    """A deterministic prompt of exactly `num_tokens` tokens (see module docstring)."""
    if num_tokens < 1:
        raise WorkloadError(f"a prompt needs at least 1 token, got {num_tokens}")
    words = [rng.choice(FIRST_WORDS)]
    words += [rng.choice(WORDS) for _ in range(num_tokens - 1)]
    return " ".join(words)


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process: the first request at t=0, exponential gaps."""
    if not (rate > 0 and math.isfinite(rate)):
        raise WorkloadError(f"rate must be a positive finite number of requests/s, got {rate}")
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def _mix_lengths(rng: random.Random, n: int) -> list[tuple[int, int, str]]:
    """(prompt_len, max_tokens, kind): 80% short answers, 20% long, exactly."""
    num_long = round(0.2 * n)
    kinds = ["long"] * num_long + ["short"] * (n - num_long)
    rng.shuffle(kinds)
    out = []
    for kind in kinds:
        prompt_len = rng.randint(8, 40)
        max_tokens = rng.randint(250, 500) if kind == "long" else rng.randint(10, 100)
        out.append((prompt_len, max_tokens, kind))
    return out


def _build(name: str, seed: int, rate: float | None, lengths: list[tuple[int, int, str]],
           arrivals: list[float], rng: random.Random, description: str,
           extra: dict | None = None) -> Workload:
    reqs = tuple(
        BenchRequest(index=i, prompt=make_prompt(p, rng), prompt_len=p, max_tokens=m,
                     arrival_s=a, kind=k)
        for i, ((p, m, k), a) in enumerate(zip(lengths, arrivals)))
    return Workload(name=name, seed=seed, rate=rate, requests=reqs, description=description,
                    extra=extra or {})


def _arrivals(n: int, rate: float | None, rng: random.Random) -> list[float]:
    return [0.0] * n if rate is None else poisson_arrivals(n, rate, rng)


def mix(seed: int = DEFAULT_SEED, rate: float | None = None, num_requests: int = 48) -> Workload:
    rng = random.Random(seed)
    lengths = _mix_lengths(rng, num_requests)
    arrivals = _arrivals(num_requests, rate, random.Random(seed + 1))
    desc = ("80% short answers (10-100 new tokens), 20% long (250-500), prompts 8-40 tokens, "
            + ("all at t=0" if rate is None else f"Poisson arrivals at {rate} req/s")
            + ", ignore_eos")
    return _build("mix", seed, rate, lengths, arrivals, rng, desc)


def poisson(seed: int = DEFAULT_SEED, rate: float | None = None,
            num_requests: int = 48) -> Workload:
    w = mix(seed, DEFAULT_POISSON_RATE if rate is None else rate, num_requests)
    return Workload("poisson", w.seed, w.rate, w.requests, w.description, w.extra)


def longprompt(seed: int = DEFAULT_SEED, rate: float | None = None, num_requests: int = 40,
               num_long: int = 4, long_prompt_len: int = 2000,
               long_max_tokens: int = 32) -> Workload:
    """`num_requests` short chats (Poisson at `rate`, default 4/s) with `num_long` 2,000-token
    prompts spread evenly through them (at 1/5, 2/5, ... of the chats' arrival span)."""
    rate = 4.0 if rate is None else rate
    if num_long < 1 or num_requests < 1:
        raise WorkloadError("longprompt needs at least one short chat and one long prompt")
    rng = random.Random(seed)
    chats = [(rng.randint(8, 40), rng.randint(20, 100), "chat") for _ in range(num_requests)]
    chat_times = poisson_arrivals(num_requests, rate, random.Random(seed + 1))
    span = chat_times[-1] if chat_times[-1] > 0 else 1.0
    longs = [(long_prompt_len, long_max_tokens, "longprompt")] * num_long
    long_times = [span * (k + 1) / (num_long + 1) for k in range(num_long)]
    merged = sorted(zip(chat_times + long_times, chats + longs), key=lambda x: x[0])
    desc = (f"{num_long} prompts of {long_prompt_len} tokens ({long_max_tokens} new tokens) "
            f"among {num_requests} short chats (8-40 prompt, 20-100 new) at {rate} req/s")
    return _build("longprompt", seed, rate, [m for _, m in merged], [t for t, _ in merged],
                  rng, desc)


def load_length_distribution(filename: str = "sharegpt_lengths.json") -> dict:
    text = resources.files("iterserve.bench").joinpath("data", filename).read_text()
    return json.loads(text)


def _lognormal_len(rng: random.Random, spec: dict) -> int:
    sigma = float(spec["sigma"])
    mu = math.log(float(spec["mean"])) - sigma * sigma / 2
    return int(min(max(round(rng.lognormvariate(mu, sigma)), spec["min"]), spec["max"]))


def sharegpt(seed: int = DEFAULT_SEED, rate: float | None = None,
             num_requests: int = 64) -> Workload:
    dist = load_length_distribution()
    if dist.get("family") != "lognormal":
        raise WorkloadError(f"unsupported length family {dist.get('family')!r}")
    rng = random.Random(seed)
    lengths = [(_lognormal_len(rng, dist["prompt"]), _lognormal_len(rng, dist["output"]),
                "sharegpt") for _ in range(num_requests)]
    arrivals = _arrivals(num_requests, rate, random.Random(seed + 1))
    n = len(lengths)
    extra = {"length_source": dist["source"]["citation"],
             "realised_mean_prompt": round(sum(p for p, _, _ in lengths) / n, 1),
             "realised_mean_output": round(sum(m for _, m, _ in lengths) / n, 1)}
    desc = ("ShareGPT-like lengths (lognormal, published means, see data/sharegpt_lengths.json), "
            + ("all at t=0" if rate is None else f"Poisson arrivals at {rate} req/s"))
    return _build("sharegpt", seed, rate, lengths, arrivals, rng, desc, extra)


def _words(n: int, rng: random.Random) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


def agent(seed: int = DEFAULT_SEED, rate: float | None = None, num_requests: int = 8,
          num_turns: int = 10, system_len: int = 2000, tool_len: tuple[int, int] = (250, 350),
          answer_len: tuple[int, int] = (20, 60)) -> Workload:
    """`num_requests` agent sessions (the sessions are the requests' owners: 8 by default)
    of `num_turns` turns each. Turn k's prompt is the shared system prompt (`system_len`
    tokens: instructions and tool schemas), then every earlier turn's tool output and answer,
    then turn k's tool output (`tool_len` tokens); it generates `answer_len` tokens, and the
    workload's own answer of that length goes into the history. Lengths are fixed by the
    seed; every session has its own tool outputs and answers."""
    if rate is not None:
        raise WorkloadError("agent sessions are closed loops (each turn waits for the last "
                            "answer); they take no arrival rate")
    if num_requests < 1 or num_turns < 1 or system_len < 1:
        raise WorkloadError("agent needs at least one session, one turn and a system prompt")
    rng = random.Random(seed)
    system = [rng.choice(FIRST_WORDS)] + _words(system_len - 1, rng)
    reqs = []
    for s in range(num_requests):
        history = list(system)
        for t in range(1, num_turns + 1):
            history += _words(rng.randint(*tool_len), rng)         # the tool's output
            answer = rng.randint(*answer_len)
            reqs.append(BenchRequest(index=len(reqs), prompt=" ".join(history),
                                     prompt_len=len(history), max_tokens=answer,
                                     arrival_s=0.0, kind="agent", session=s, turn=t))
            history += _words(answer, rng)                          # the answer it gave
    desc = (f"{num_requests} agent sessions x {num_turns} turns: a shared {system_len}-token "
            f"system prompt with tools, each turn the whole conversation plus "
            f"{tool_len[0]}-{tool_len[1]} tokens of tool output, answers of "
            f"{answer_len[0]}-{answer_len[1]} tokens, ignore_eos; closed loop per session")
    return Workload("agent", seed, None, tuple(reqs), desc,
                    {"num_sessions": num_requests, "num_turns": num_turns,
                     "system_len": system_len})



_EDIT_BODIES = (
    "    return {a} + {b}",
    "    if {a} > {b}:\n        return {a}\n    return {b}",
    "    for {c} in range({a}):\n        {b} = {b} + {c}\n    return {b}",
    "    {c} = [{a}, {b}]\n    return sorted({c})",
    "    {c} = {a} * 2\n    if not {c}:\n        raise ValueError(\"{a} is empty\")\n    return {c} - {b}",
    "    return {{\"{a}\": {a}, \"{b}\": {b}}}",
)


def _estimate_tokens(text: str) -> int:
    """Words, numbers and punctuation marks, one token each; indentation runs count once."""
    import re
    return len(re.findall(r"[A-Za-z_]+|[0-9]+|\n +|[^\sA-Za-z_0-9]", text))


def _edit_file(rng: random.Random, target_tokens: int) -> tuple[str, list[str]]:
    """A Python file of about `target_tokens` tokens: functions named from `WORDS`."""
    funcs, names, used = [], [], set()
    while _estimate_tokens("\n\n".join(funcs)) < target_tokens:
        name = "_".join(rng.sample(WORDS[20:], 2))
        if name in used:
            continue
        used.add(name)
        a, b, c = rng.sample(WORDS[20:], 3)
        body = rng.choice(_EDIT_BODIES).format(a=a, b=b, c=c)
        funcs.append(f"def {name}({a}, {b}):\n    \"\"\"{rng.choice(WORDS).capitalize()} "
                     f"{' '.join(rng.sample(WORDS, 5))}.\"\"\"\n{body}")
        names.append(name)
    return "\n\n\n".join(funcs) + "\n", names


def edit(seed: int = DEFAULT_SEED, rate: float | None = None, num_requests: int = 8,
         min_file_tokens: int = 300, max_file_tokens: int = 800) -> Workload:
    """Each prompt: a file and an instruction to rename one function (an instruction, so send
    it to the chat endpoint); max_tokens is the file's length, so a faithful answer is the
    file again."""
    rng = random.Random(seed)
    arrivals = _arrivals(num_requests, rate, random.Random(seed + 1))
    reqs = []
    for i in range(num_requests):
        text, names = _edit_file(rng, rng.randint(min_file_tokens, max_file_tokens))
        old = rng.choice(names)
        new = "_".join(rng.sample(WORDS[20:], 2))
        prompt = (f"Here is the file `module_{i}.py`:\n\n```python\n{text}```\n\n"
                  f"Rename the function `{old}` to `{new}` and reply with the whole file.")
        file_tokens = _estimate_tokens(text)
        reqs.append(BenchRequest(index=i, prompt=prompt, prompt_len=_estimate_tokens(prompt),
                                 max_tokens=file_tokens, arrival_s=arrivals[i], kind="edit"))
    desc = (f"a {min_file_tokens}-{max_file_tokens}-token Python file quoted back with one "
            "function renamed (the answer repeats the prompt), "
            + ("all at t=0" if rate is None else f"Poisson arrivals at {rate} req/s")
            + ", ignore_eos")
    return Workload(name="edit", seed=seed, rate=rate, requests=tuple(reqs), description=desc,
                    extra={"token_counts": "estimated (words, numbers, punctuation)"})


WORKLOADS = {"mix": mix, "poisson": poisson, "longprompt": longprompt, "sharegpt": sharegpt,
             "agent": agent, "edit": edit}


def build_workload(name: str, *, seed: int = DEFAULT_SEED, rate: float | None = None,
                   num_requests: int | None = None) -> Workload:
    """Build a workload by name. `rate` (requests/s) turns arrivals into a Poisson process
    (for `mix` that is exactly `poisson`); `num_requests` overrides the default count (for
    `agent`, the number of sessions)."""
    try:
        factory = WORKLOADS[name]
    except KeyError:
        raise WorkloadError(
            f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}") from None
    if rate is not None and not (rate > 0 and math.isfinite(rate)):
        raise WorkloadError(f"rate must be a positive finite number of requests/s, got {rate}")
    if num_requests is not None and num_requests < 1:
        raise WorkloadError(f"num_requests must be at least 1, got {num_requests}")
    kwargs = {"seed": seed, "rate": rate}
    if num_requests is not None:
        kwargs["num_requests"] = num_requests
    return factory(**kwargs)
