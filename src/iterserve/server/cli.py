"""`iterserve serve`: load a model and serve the OpenAI-compatible API with uvicorn.

With no --model it serves the bundled default model on 127.0.0.1:8000 (`make serve`).
uvicorn handles SIGINT/SIGTERM: it stops accepting connections, gives in-flight responses
`--shutdown-timeout` seconds to finish, then cancels them (which aborts their requests),
and the app's lifespan shuts the engine down.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20      # = server.app.DEFAULT_MAX_REQUEST_BODY_BYTES


def register(subparsers: argparse._SubParsersAction) -> None:
    from iterserve.engine.args import EngineArgs

    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (completions, chat, "
                    "SSE streaming, /metrics, request traces, the /lab page).")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on every route but /health, "
                        "/ping and the lab page")
    g.add_argument("--metrics-require-auth", action="store_true",
                   help="with --api-key, /metrics needs the key too (off: Prometheus "
                        "scrapers usually send none)")
    g.add_argument("--max-request-body-bytes", type=int,
                   default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="larger bodies get 413 (default %(default)s = 4 MiB)")
    g.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds in-flight requests may run on after SIGINT/SIGTERM; then "
                        "they end with finish_reason 'abort' and the process exits within "
                        "about one more second")
    g.add_argument("--debug-check-consistency", action="store_true",
                   help="check the scheduler's books after every step (they are always "
                        "checked when the engine goes idle)")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_openai_cli_args(p)
    EngineArgs.add_cli_args(p)
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="with --data-parallel-size > 1: join this Ray cluster ('auto', "
                        "'HOST:PORT') instead of starting a local one")
    p.set_defaults(func=run)


def add_openai_cli_args(p: argparse.ArgumentParser) -> None:
    """vLLM's spellings of the frontend flags (server/serving_config.py says what each does),
    so a pasted `vllm serve MODEL ...` command line works."""
    from iterserve.tools import TOOL_PARSERS

    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (same as --model)")
    g = p.add_argument_group("OpenAI frontend (vLLM's flags)")
    g.add_argument("--chat-template", default=None, metavar="FILE|STRING",
                   help="a Jinja chat template (a file, or the template itself) used instead "
                        "of the model's")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a request's own chat_template (off: such requests get a 400; "
                        "a template is a program the server runs)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto"); needs '
                        "--tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls: hermes (Qwen2.5/3, Hermes, "
                        "SmolLM3), llama3_json (Llama 3.x), mistral; also the format forced "
                        'for tool_choice "required" / named (default hermes)')
    from iterserve.reasoning import REASONING_PARSERS
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split the model's thinking into message.reasoning_content: "
                        "deepseek_r1 (output starts thinking, up to </think>), qwen3 "
                        "(<think>...</think> when the output opens with it), openai_gptoss "
                        "(gpt-oss's analysis channel); structured outputs and forced tool "
                        "calls then apply to the answer only")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="auto (default): the model's generation_config.json supplies default "
                        "temperature / top_p / top_k / min_p / repetition_penalty / max_tokens "
                        "for requests that leave them unset; vllm: ignore it; DIR: read "
                        "DIR/generation_config.json")
    g.add_argument("--uvicorn-log-level", default=None,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log level (default: --log-level)")
    logs = g.add_mutually_exclusive_group()
    logs.add_argument("--enable-log-requests", dest="log_requests", action="store_true",
                      default=False, help="log each request's prompt and sampling params")
    logs.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                      help="do not log requests (the default, as in current vLLM)")
    g.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="with --enable-log-requests: at most N prompt characters and token ids "
                        "per logged request (default: all)")


def resolve_model_args(args: argparse.Namespace) -> None:
    """The positional MODEL and --model are one setting (--tokenizer is the engine's flag:
    engine/args.py)."""
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise ValueError(f"the model is given twice: positional {tag!r} and --model "
                             f"{args.model!r}")
        args.model = tag
    if getattr(args, "max_log_len", None) is not None and args.max_log_len < 0:
        raise ValueError("--max-log-len must be at least 0")


def serving_config_from_args(args: argparse.Namespace, model: str | None):
    from iterserve.server.serving_config import (
        ServingConfig, load_chat_template, load_generation_defaults)
    from iterserve.server.serving_tools import ToolServerConfig

    return ServingConfig(
        chat_template=load_chat_template(args.chat_template),
        trust_request_chat_template=args.trust_request_chat_template,
        tools=ToolServerConfig(enable_auto_tool_choice=args.enable_auto_tool_choice,
                               tool_call_parser=args.tool_call_parser),
        sampling_defaults=load_generation_defaults(args.generation_config, model),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        log_requests=args.log_requests, max_log_len=args.max_log_len)


def build_app(args: argparse.Namespace):
    from iterserve.engine.args import EngineArgs
    from iterserve.engine.async_engine import AsyncEngine
    from iterserve.server.app import create_app

    resolve_model_args(args)
    engine_args = EngineArgs.from_cli_args(args)
    serving_config = serving_config_from_args(args, engine_args.model)
    if args.max_request_body_bytes < 1:
        raise ValueError("--max-request-body-bytes must be at least 1")
    if args.metrics_require_auth and not args.api_key:
        raise ValueError("--metrics-require-auth needs --api-key")
    if engine_args.data_parallel_size > 1:          # replicas on Ray Serve (replicas/)
        from iterserve.replicas import start_pool
        engine = start_pool(engine_args, ray_address=getattr(args, "ray_address", None),
                            debug_check_consistency=args.debug_check_consistency)
    else:
        engine = AsyncEngine.from_engine_args(
            engine_args, debug_check_consistency=args.debug_check_consistency)
    return create_app(engine, served_model_name=engine_args.served_model_name,
                      api_key=args.api_key, metrics_require_auth=args.metrics_require_auth,
                      max_request_body_bytes=args.max_request_body_bytes,
                      model_root=engine_args.model, serving_config=serving_config), engine


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from iterserve.core.config import ConfigError

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from iterserve.engine import omp_policy        # before anything loads torch (libgomp)
    omp_policy.apply(getattr(args, "omp_wait_policy", "env"))
    from iterserve.replicas.launch import RayNotInstalledError

    try:
        app, engine = build_app(args)
    except (ConfigError, ValueError, FileNotFoundError, RayNotInstalledError) as e:
        print(f"iterserve serve: {e}", file=sys.stderr)
        return 2
    print(f"iterserve: serving {engine.model_name!r} on http://{args.host}:{args.port} "
          f"(max_model_len {engine.max_model_len})", file=sys.stderr, flush=True)
    # After the drain (DrainingServer) every stream ends within a step or two; uvicorn's own
    # graceful wait only covers responses still being written.
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level or args.log_level,
                            timeout_graceful_shutdown=0.5)
    server = DrainingServer(config, engine, drain_timeout=args.shutdown_timeout)

    # uvicorn re-raises the signal that stopped it once it is done; by then the shutdown
    # is complete, so exit 0 instead of dying by that signal.
    def _exit_cleanly(signum, frame):
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, _exit_cleanly)
    code = 0
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    except SystemExit as e:
        code = int(e.code or 0)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if getattr(engine, "app_name", None):          # a replica pool: stop its replicas
            from iterserve.replicas import close_pool
            close_pool(engine)
    # Everything is shut down (streams ended, engine stopped, aborts flushed). Interpreter
    # teardown with torch loaded took ~0.9 s more, which would break the promise that the
    # process is gone within --shutdown-timeout + 1 s; so leave without it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class DrainingServer:
    """uvicorn.Server whose shutdown first stops accepting, then lets in-flight requests
    finish for `drain_timeout` seconds and aborts the rest in the engine, so every open
    stream ends with finish_reason "abort" (and its usage chunk), then `[DONE]`, instead of
    a cut connection; the whole shutdown takes at most about drain_timeout + 1 s."""

    def __new__(cls, config, engine, *, drain_timeout: float):
        import uvicorn

        class _Server(uvicorn.Server):
            async def shutdown(self, sockets=None):
                for srv in self.servers:
                    srv.close()                     # stop accepting
                try:
                    await engine.shutdown(drain_timeout=drain_timeout)
                except Exception:                   # never block the rest of the shutdown
                    logging.getLogger(__name__).exception("engine shutdown failed")
                await super().shutdown(sockets)

        return _Server(config)
