"""`iterserve serve` with vLLM's frontend spellings: a positional MODEL,
--chat-template FILE|STRING, --enable-auto-tool-choice / --tool-call-parser,
--generation-config, --tokenizer, --uvicorn-log-level, --enable/--disable-log-requests,
--max-log-len. Parsing and build_app run in-process; one real process serves a pasted
vLLM-style command line and answers a tool call through the official client."""

from __future__ import annotations

import json
import logging
import shutil

import openai
import pytest

from iterserve.cli import build_parser
from iterserve.errors import TokenizerLoadError
from iterserve.server.cli import build_app, resolve_model_args, serving_config_from_args

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if tools %}TOOLS{% endif %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def parse(*argv: str):
    return build_parser("serve").parse_args(["serve", *argv])


def test_positional_model_is_the_model(tiny_model_dir):
    args = parse(str(tiny_model_dir), "--port", "1")
    resolve_model_args(args)
    assert args.model == str(tiny_model_dir)
    args = parse("--model", str(tiny_model_dir), str(tiny_model_dir))
    resolve_model_args(args)
    with pytest.raises(ValueError, match="twice"):
        resolve_model_args(parse("--model", "/a", "/b"))


def _separate_tokenizer(tmp_path, vocab_size: int = 512):
    """A tokenizer directory of its own, marked by its chat template."""
    from fixtures.tiny_tokenizer import write_tiny_tokenizer
    d = tmp_path / f"tok-{vocab_size}"
    write_tiny_tokenizer(d, vocab_size)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "SEPARATE{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_separate_tokenizer_for_an_hf_model_without_one(tmp_path, tiny_model_dir):
    """vLLM's --tokenizer: a model directory with no tokenizer files serves with the given
    one (directory or tokenizer.json); a tokenizer too big for the model fails at start."""
    from iterserve import LLM, SamplingParams

    bare = tmp_path / "bare-model"
    shutil.copytree(tiny_model_dir, bare)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (bare / f).unlink()
    tok_dir = _separate_tokenizer(tmp_path)
    args = parse(str(bare), "--tokenizer", str(tok_dir))
    from iterserve.engine.args import EngineArgs
    assert EngineArgs.from_cli_args(args).tokenizer == str(tok_dir)
    for path in (tok_dir, tok_dir / "tokenizer.json"):
        llm = LLM(str(bare), tokenizer=str(path), num_kv_blocks=32, max_model_len=128)
        assert llm.get_tokenizer().chat_template.startswith("SEPARATE")
        ref = LLM(str(tiny_model_dir), num_kv_blocks=32, max_model_len=128)
        p = SamplingParams(max_tokens=4, temperature=0)
        assert llm.generate("hello there", p, use_tqdm=False)[0].outputs[0].token_ids == \
            ref.generate("hello there", p, use_tqdm=False)[0].outputs[0].token_ids
        del llm, ref
    with pytest.raises(TokenizerLoadError, match=r"--tokenizer .*1024 tokens.*512 rows"):
        LLM(str(bare), tokenizer=str(_separate_tokenizer(tmp_path, 1024)), num_kv_blocks=32)
    with pytest.raises(TokenizerLoadError, match="does not exist"):
        LLM(str(bare), tokenizer=str(tmp_path / "missing"), num_kv_blocks=32)
    with pytest.raises(ValueError, match="1024 tokens"):          # the serve path says it too
        build_app(parse(str(bare), "--tokenizer", str(_separate_tokenizer(tmp_path, 1024)),
                        "--num-kv-blocks", "32"))


def test_separate_tokenizer_for_a_gguf_model(tmp_path):
    from fixtures.tiny_gguf import write_tiny_llama_gguf

    from iterserve import LLM, SamplingParams
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path)
    own = LLM(str(path), num_kv_blocks=32, max_model_len=128)
    sep = LLM(str(path), tokenizer=str(_separate_tokenizer(tmp_path)), num_kv_blocks=32,
              max_model_len=128)
    assert sep.get_tokenizer().chat_template.startswith("SEPARATE")
    assert not (own.get_tokenizer().chat_template or "").startswith("SEPARATE")
    p = SamplingParams(max_tokens=3, temperature=0)
    assert sep.generate("hello", p, use_tqdm=False)[0].outputs[0].token_ids
    # a .gguf file as the tokenizer: its metadata's tokenizer
    again = LLM(str(path), tokenizer=str(path), num_kv_blocks=32, max_model_len=128)
    assert again.get_tokenizer().encode("hello there") == own.get_tokenizer().encode("hello there")


def test_chat_template_file_or_string(tmp_path, tiny_model_dir):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    for value in (str(f), TEMPLATE):
        args = parse(str(tiny_model_dir), "--chat-template", value)
        assert serving_config_from_args(args, args.model).chat_template == TEMPLATE
    with pytest.raises(ValueError, match="no such file"):
        serving_config_from_args(parse("--chat-template", str(tmp_path / "missing.jinja")),
                                 None)


def test_tool_flags(tiny_model_dir):
    args = parse(str(tiny_model_dir), "--enable-auto-tool-choice", "--tool-call-parser",
                 "llama3_json")
    cfg = serving_config_from_args(args, args.model).tools
    assert cfg.enable_auto_tool_choice and cfg.tool_call_parser == "llama3_json"
    with pytest.raises(ValueError, match="--tool-call-parser"):
        serving_config_from_args(parse("--enable-auto-tool-choice"), None)
    with pytest.raises(SystemExit):
        parse("--tool-call-parser", "pythonic")          # not a parser iterserve has


def test_generation_config_supplies_sampling_defaults(tmp_path, tiny_model_dir):
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_k": 5, "max_new_tokens": 3, "do_sample": True}))
    auto = serving_config_from_args(parse(str(model)), str(model)).sampling_defaults
    assert auto == {"temperature": 0.0, "top_k": 5, "max_tokens": 3}
    assert serving_config_from_args(parse(str(model), "--generation-config", "vllm"),
                                    str(model)).sampling_defaults == {}
    assert serving_config_from_args(
        parse(str(tiny_model_dir), "--generation-config", str(model)),
        str(tiny_model_dir)).sampling_defaults == auto
    with pytest.raises(ValueError, match="generation_config.json"):
        serving_config_from_args(parse("--generation-config", str(tmp_path)), None)
    # through the server: an unset max_tokens / temperature comes from the file
    from fastapi.testclient import TestClient
    app, _ = build_app(parse(str(model), "--num-kv-blocks", "64", "--max-model-len", "256"))
    with TestClient(app) as c:
        outs = [c.post("/v1/completions", json={"prompt": "Hello"}).json() for _ in range(2)]
        assert [o["usage"]["completion_tokens"] for o in outs] == [3, 3]
        assert outs[0]["choices"][0]["text"] == outs[1]["choices"][0]["text"]   # greedy
        r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5,
                                            "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 5                 # the request wins


def test_request_logging_and_max_log_len(tiny_model_dir, caplog):
    from fastapi.testclient import TestClient
    args = parse(str(tiny_model_dir), "--num-kv-blocks", "64", "--max-model-len", "256",
                 "--enable-log-requests", "--max-log-len", "5")
    app, _ = build_app(args)
    with caplog.at_level(logging.INFO, logger="iterserve.requests"), TestClient(app) as c:
        assert c.post("/v1/completions", json={"prompt": "Hello world, how are you",
                                               "max_tokens": 1}).status_code == 200
    (rec,) = [r for r in caplog.records if r.name == "iterserve.requests"]
    assert "Received request cmpl-" in rec.getMessage()
    assert "'Hello'" in rec.getMessage() and "world" not in rec.getMessage()
    caplog.clear()
    app, _ = build_app(parse(str(tiny_model_dir), "--num-kv-blocks", "64",
                             "--max-model-len", "256", "--disable-log-requests"))
    with caplog.at_level(logging.INFO, logger="iterserve.requests"), TestClient(app) as c:
        c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
    assert not [r for r in caplog.records if r.name == "iterserve.requests"]


def test_a_pasted_vllm_command_line_serves_tool_calls(tiny_model_dir, tmp_path):
    """`iterserve serve MODEL` with vLLM's flags, as a process, then a tool call. A real
    process because the positional MODEL, --uvicorn-log-level and the flag set only meet in
    `iterserve serve`'s own startup: ~5 s on a quiet machine (19 s at load average 21)."""
    import os
    import socket
    import subprocess
    import sys
    import time

    import httpx

    f = tmp_path / "tools.jinja"
    f.write_text(TEMPLATE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "iterserve.cli", "serve", str(tiny_model_dir), "--port",
         str(port), "--num-kv-blocks", "64", "--max-model-len", "512", "--chat-template",
         str(f), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
         "--generation-config", "auto", "--uvicorn-log-level", "warning",
         "--disable-log-requests", "--max-log-len", "100", "--dtype", "auto"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        tools = [{"type": "function", "function": {"name": "ping", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                   "maximum": 9}},
            "required": ["n"], "additionalProperties": False}}}]
        msgs = [{"role": "user", "content": "ping"}]
        r = c.chat.completions.create(model=str(tiny_model_dir.name), messages=msgs,
                                      tools=tools, tool_choice="required", max_tokens=60,
                                      parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "ping" and 0 <= json.loads(call.function.arguments)["n"] <= 9
        # auto is allowed on this server (a random model writes no call: plain content)
        r = c.chat.completions.create(model=str(tiny_model_dir.name), messages=msgs,
                                      tools=tools, max_tokens=3)
        assert r.choices[0].message.tool_calls is None
        # the server's template (it marks that tools were given) is the one in use
        tok = httpx.post(base + "/tokenize", json={"messages": msgs, "tools": tools}).json()
        plain = httpx.post(base + "/tokenize", json={"messages": msgs}).json()
        assert tok["count"] > plain["count"]
        assert r.usage.prompt_tokens == tok["count"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
