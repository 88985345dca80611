"""vLLM's launch flags on `iterserve serve`: launch lines as vLLM's docs write them, each with
its outcome (served, served with one start-up notice, refused naming what it needs, or an
argparse error), and the HTTP / chat / usage flags driven through real servers with the
official `openai` client."""

from __future__ import annotations

import shlex
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from iterserve.cli import parse_args
from iterserve.errors import ConfigError
from iterserve.server import http_options
from iterserve.server.cli import build_app, prepare_launch

# (launch line, outcome): "ok", "notice: <text of the notice>", "refused: <text>", "usage"
LAUNCH_LINES = [
    ("vllm serve MODEL --gpu-memory-utilization 0.9 --max-model-len 512", "ok"),
    ("vllm serve MODEL --dtype auto --api-key token-abc123 --enforce-eager", "ok"),
    ("vllm serve MODEL --disable-log-stats --max-logprobs 5", "ok"),
    ("vllm serve MODEL --kv-cache-memory-bytes 8G", "ok"),
    ("vllm serve MODEL --served-model-name my-model other-name", "ok"),
    ("vllm serve MODEL --uds /tmp/vllm.sock", "ok"),
    ("vllm serve MODEL --allowed-origins '[\"*\"]' --allowed-methods '[\"GET\", \"POST\"]' "
     "--allowed-headers '[\"*\"]' --allow-credentials --root-path /llm", "ok"),
    ("vllm serve MODEL --tokenizer-mode auto --load-format auto --quantization none", "ok"),
    ("vllm serve MODEL --chat-template-content-format openai --default-chat-template-kwargs "
     "'{\"enable_thinking\": false}' --response-role assistant "
     "--exclude-tools-when-tool-choice-none", "ok"),
    ("vllm serve MODEL --override-generation-config '{\"temperature\": 0.5}' "
     "--generation-config vllm", "ok"),
    ("vllm serve MODEL --enable-prompt-tokens-details --enable-force-include-usage", "ok"),
    ("vllm serve MODEL --disable-uvicorn-access-log --disable-fastapi-docs "
     "--enable-request-id-headers", "ok"),
    ("vllm serve MODEL --structured-outputs-config '{\"disable_any_whitespace\": true}'", "ok"),
    ("vllm serve MODEL --runner generate --logprobs-mode raw_logprobs", "ok"),
    ("vllm serve MODEL --limit-mm-per-prompt '{\"image\": 0}'", "ok"),
    ("vllm serve MODEL --trust-remote-code", "notice: --trust-remote-code has no effect"),
    ("vllm serve MODEL --revision main", "notice: --revision has no effect"),
    ("vllm serve MODEL --download-dir /tmp/models", "notice: --download-dir has no effect"),
    ("vllm serve MODEL --max-parallel-loading-workers 2",
     "notice: --max-parallel-loading-workers has no effect"),
    ("vllm serve MODEL --async-scheduling", "notice: --async-scheduling has no effect"),
    ("vllm serve MODEL --prefix-caching-hash-algo sha256",
     "notice: --prefix-caching-hash-algo has no effect"),
    ("vllm serve MODEL --structured-outputs-config '{\"backend\": \"xgrammar\"}'",
     "notice: backend 'xgrammar' is not available"),
    ("vllm serve MODEL --enable-lora --lora-modules sql-lora=/adapters/sql",
     "refused: LoRA adapters are not supported yet"),
    ("vllm serve MODEL --max-loras 2", "refused: LoRA adapters are not supported yet"),
    ("vllm serve MODEL --speculative-config "
     "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4}'",
     "ok"),
    ("vllm serve MODEL --reasoning-parser deepseek_r1", "ok"),
    ("vllm serve MODEL --reasoning-parser nonesuch", "usage"),
    ("vllm serve MODEL --pipeline-parallel-size 2",
     "refused: pipeline parallelism is not implemented"),
    ("vllm serve MODEL -q awq", "refused: --quantization awq: not supported"),
    ("vllm serve MODEL --runner pooling", "ok"),
    ("vllm serve MODEL --runner pooling --convert embed --pooler-config "
     "'{\"pooling_type\": \"MEAN\", \"normalize\": true}'", "ok"),
    ("vllm serve MODEL --task embed --hf-overrides '{\"is_matryoshka\": true}'", "ok"),
    ("vllm serve MODEL --convert classify", "refused: --convert classify: classification"),
    ("vllm serve MODEL --task score", "refused: --task score: classification"),
    ("vllm serve MODEL --tokenizer-mode mistral", "refused: --tokenizer-mode mistral"),
    ("vllm serve MODEL --logprobs-mode processed_logprobs",
     "refused: --logprobs-mode processed_logprobs"),
    ("vllm serve MODEL --limit-mm-per-prompt '{\"image\": 2}'",
     "refused: iterserve serves text-only models"),
    ("vllm serve MODEL --kv-cache-memory-bytes 1.5G", "usage"),
    ("vllm serve MODEL --default-chat-template-kwargs not-json", "usage"),
]


def _argv(line: str, model_dir) -> list[str]:
    words = shlex.split(line.replace("MODEL", str(model_dir)))
    assert words[0] == "vllm"
    return words[1:]


@pytest.mark.parametrize("line,outcome", LAUNCH_LINES, ids=[l for l, _ in LAUNCH_LINES])
def test_a_vllm_launch_line_is_served_noticed_or_refused(line, outcome, tiny_model_dir, capsys):
    argv = _argv(line, tiny_model_dir)
    if outcome == "usage":
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2
        assert "error" in capsys.readouterr().err
        return
    _, args = parse_args(argv)
    if outcome.startswith("refused: "):
        with pytest.raises(ConfigError) as e:
            prepare_launch(args)
        assert outcome.removeprefix("refused: ") in str(e.value)
        return
    launch = prepare_launch(args)
    if outcome == "ok":
        assert launch.notices == []
    else:
        (notice,) = launch.notices                      # one start-up line, saying why
        assert outcome.removeprefix("notice: ") in notice


def test_the_reasoning_parser_flag_reaches_the_serving_config(tiny_model_dir):
    _, args = parse_args(_argv("vllm serve MODEL --reasoning-parser qwen3 "
                               "--tool-call-parser openai", tiny_model_dir))
    launch = prepare_launch(args)
    assert launch.serving_config.reasoning_parser == "qwen3"
    assert launch.serving_config.tools.tool_call_parser == "openai"


def test_vllm_size_spelling_and_several_served_names(tiny_model_dir):
    _, args = parse_args(_argv("vllm serve MODEL --kv-cache-memory-bytes 25.6k "
                               "--served-model-name a b", tiny_model_dir))
    ea = prepare_launch(args).engine_args
    assert ea.kv_cache_memory_bytes == 25_600 and ea.served_model_names == ["a", "b"]
    cache = ea.create_cache_config(bytes_per_block=1000)
    assert cache.num_kv_blocks == 25                    # the byte budget sizes the KV pool


def test_config_file_flags_and_the_command_line_wins(tiny_model_dir, tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"model: {tiny_model_dir}\nmax-model-len: 300\nenable_prefix_caching: true\n"
                   "served-model-name: [a, b]\ndefault-chat-template-kwargs: {x: 1}\n")
    _, args = parse_args(["serve", "--config", str(cfg), "--max-model-len", "200"])
    assert args.model == str(tiny_model_dir) and args.max_model_len == 200
    assert args.enable_prefix_caching is True and args.served_model_name == ["a", "b"]
    assert args.default_chat_template_kwargs == {"x": 1}
    cfg.write_text("no-such-flag: 1\n")
    with pytest.raises(SystemExit):
        parse_args(["serve", "--config", str(cfg)])


# --- live servers, through the CLI's own path (parse_args, build_app, uvicorn options) ----

TEMPLATE = ("{{ greeting | default('') }}|{% if tools %}TOOLS|{% endif %}"
            "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
            "{% endfor %}")


class Live:
    def __init__(self, argv: list[str]) -> None:
        _, args = parse_args(argv)
        self.app, self.engine = build_app(args)
        self.launch = prepare_launch(args)
        opts = http_options.uvicorn_options(self.launch.server)
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning",
                                                    timeout_graceful_shutdown=2, **opts))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "no start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        assert not self.thread.is_alive(), "server did not shut down"


def _port() -> str:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("flags")
    (d / "template.jinja").write_text(TEMPLATE)
    cfg = d / "config.yaml"
    cfg.write_text(
        f"model: {tiny_model_dir}\nserved-model-name: [tiny, alias]\nmax-logprobs: 3\n"
        "response-role: bot\nenable-force-include-usage: true\n"
        "enable-prompt-tokens-details: true\nenable-request-id-headers: true\n"
        "root-path: /llm\nallowed-origins: ['http://ui.example']\n"
        "enable-prefix-caching: true\nexclude-tools-when-tool-choice-none: true\n"
        f"chat-template: {d / 'template.jinja'}\n"
        "default-chat-template-kwargs: {greeting: HELLO}\n")
    port = _port()
    s = Live(["serve", "--config", str(cfg), "--host", "127.0.0.1", "--port", port,
              "--num-kv-blocks", "64", "--max-model-len", "256", "--disable-log-stats"])
    s.base = f"http://127.0.0.1:{port}/llm"
    yield s
    s.stop()


def test_served_names_root_path_and_request_id_headers(live):
    client = openai.OpenAI(base_url=live.base + "/v1", api_key="x")
    assert [m.id for m in client.models.list()] == ["tiny", "alias"]
    raw = client.chat.completions.with_raw_response.create(
        model="alias", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert raw.headers["x-request-id"]
    reply = raw.parse()
    assert reply.model == "tiny" and reply.choices[0].message.role == "bot"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user",
                                                                 "content": "hi"}])


def test_max_logprobs_is_enforced_and_published(live):
    client = openai.OpenAI(base_url=live.base + "/v1", api_key="x")
    msgs = [{"role": "user", "content": "hi"}]
    ok = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1,
                                        logprobs=True, top_logprobs=3)
    assert len(ok.choices[0].logprobs.content[0].top_logprobs) == 3
    with pytest.raises(openai.BadRequestError, match="max-logprobs"):
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1,
                                       logprobs=True, top_logprobs=4)
    schema = httpx.get(live.base + "/openapi.json").json()
    props = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert '"maximum": 3' in str(props["top_logprobs"]).replace("'", '"')


def test_streams_carry_usage_with_cached_tokens(live):
    client = openai.OpenAI(base_url=live.base + "/v1", api_key="x")
    prompt = "the same long prompt " * 8
    for _ in range(2):
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                                stream=True, extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage                                # no stream_options asked for it
    assert usage is not None and usage.completion_tokens == 2
    assert usage.prompt_tokens_details.cached_tokens > 0   # the second run hit the cache


def test_template_kwargs_content_parts_and_hidden_tools(live):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

    def rendered(**extra) -> str:
        r = httpx.post(live.base + "/tokenize", json={
            "model": "tiny", "messages": [{"role": "user", "content": "abc"}], **extra})
        assert r.status_code == 200, r.text
        return httpx.post(live.base + "/detokenize",
                          json={"model": "tiny", "tokens": r.json()["tokens"]}).json()["prompt"]

    assert rendered() == "HELLO|abc"            # default kwargs; content as OpenAI's parts
    assert rendered(chat_template_kwargs={"greeting": "HI"}) == "HI|abc"
    assert rendered(tools=tools) == "HELLO|TOOLS|abc"
    client = openai.OpenAI(base_url=live.base + "/v1", api_key="x")

    def prompt_tokens(**extra) -> int:
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "abc"}], max_tokens=1,
            **extra).usage.prompt_tokens
    # tool_choice "none" with --exclude-tools-when-tool-choice-none: the template sees none
    assert prompt_tokens(tools=tools, tool_choice="none") == prompt_tokens()


def test_cors_preflight_for_an_allowed_origin_only(live):
    def preflight(origin):
        return httpx.options(live.base + "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
    assert preflight("http://ui.example").headers["access-control-allow-origin"] == \
        "http://ui.example"
    assert "access-control-allow-origin" not in preflight("http://evil.example").headers


def test_unix_socket_and_no_docs(tiny_model_dir, tmp_path):
    sock = str(tmp_path / "s.sock")
    s = Live(["serve", "--model", str(tiny_model_dir), "--uds", sock, "--num-kv-blocks", "32",
              "--max-model-len", "128", "--disable-fastapi-docs", "--disable-log-stats"])
    try:
        http = httpx.Client(transport=httpx.HTTPTransport(uds=sock))
        client = openai.OpenAI(base_url="http://localhost/v1", api_key="x", http_client=http)
        out = client.completions.create(model=s.engine.model_name, prompt="Hello",
                                        max_tokens=2, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 2
        assert http.get("http://localhost/docs").status_code == 404
        assert http.get("http://localhost/openapi.json").status_code == 404
    finally:
        s.stop()


def test_https_with_ssl_flags(tiny_model_dir, tmp_path):
    import subprocess
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)
    port = _port()
    s = Live(["serve", "--model", str(tiny_model_dir), "--host", "127.0.0.1", "--port", port,
              "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--num-kv-blocks", "32",
              "--max-model-len", "128", "--disable-log-stats"])
    try:
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key="x",
                               http_client=httpx.Client(verify=str(cert)))
        out = client.completions.create(model=s.engine.model_name, prompt="Hi", max_tokens=1)
        assert out.usage.completion_tokens == 1
    finally:
        s.stop()
