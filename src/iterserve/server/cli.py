"""`iterserve serve`: load a model and serve the OpenAI-compatible API with uvicorn.

With no --model it serves the bundled default model on 127.0.0.1:8000 (`make serve`).
uvicorn handles SIGINT/SIGTERM: it stops accepting connections, gives in-flight responses
`--shutdown-timeout` seconds to finish, then cancels them (which aborts their requests),
and the app's lifespan shuts the engine down. Every flag is a knob of core/config.py (the
server's and the OpenAI frontend's configs, then EngineArgs's), generated from there.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from iterserve import envs
from iterserve.core.config import (
    SERVER_CONFIGS, FrontendConfig, ServerConfig, add_config_arguments, config_from,
    knob_notices)
from iterserve.engine import omp_policy
from iterserve.engine.args import EngineArgs
from iterserve.engine.async_engine import AsyncEngine
from iterserve.errors import ConfigError, RayNotInstalledError
from iterserve.replicas import close_pool, start_pool
from iterserve.server.serving_config import (ServingConfig, load_chat_template,
                                             load_generation_defaults)
from iterserve.server.serving_tools import ToolServerConfig

logger = logging.getLogger("iterserve.serve")

def register(subparsers: argparse._SubParsersAction) -> None:
    """`iterserve serve`: every flag comes from the knob schema (core/config.py): the
    server's and the OpenAI frontend's configs, then EngineArgs's."""
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (completions, chat, "
                    "SSE streaming, /metrics, request traces, the /lab page).",
        epilog=ENVIRONMENT_EPILOG)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (same as --model)")
    add_config_arguments(p, SERVER_CONFIGS)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def _environment_epilog() -> str:
    return ("environment variables (" + ", ".join(envs.VARIABLES) + "): what each does is "
            "in README.md, section 'Environment variables' (or run `python -m iterserve.envs`)")


ENVIRONMENT_EPILOG = _environment_epilog()


def resolve_model_args(args: argparse.Namespace) -> None:
    """The positional MODEL and --model are one setting (--tokenizer is the engine's flag:
    engine/args.py)."""
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise ValueError(f"the model is given twice: positional {tag!r} and --model "
                             f"{args.model!r}")
        args.model = tag


def serving_config_from_args(args: argparse.Namespace, model: str | None):
    f = config_from(FrontendConfig, vars(args))
    return ServingConfig(
        chat_template=load_chat_template(f.chat_template),
        trust_request_chat_template=f.trust_request_chat_template,
        tools=ToolServerConfig(enable_auto_tool_choice=f.enable_auto_tool_choice,
                               tool_call_parser=f.tool_call_parser),
        sampling_defaults=load_generation_defaults(f.generation_config, model),
        log_requests=f.enable_log_requests, max_log_len=f.max_log_len)


def build_app(args: argparse.Namespace):
    # fastapi: for `serve` only (`iterserve --help` builds every subcommand's parser)
    from iterserve.server.app import create_app

    resolve_model_args(args)
    engine_args = EngineArgs.from_cli_args(args)
    server = config_from(ServerConfig, vars(args))
    serving_config = serving_config_from_args(args, engine_args.model)
    for line in knob_notices(server, config_from(FrontendConfig, vars(args)), engine_args):
        logger.warning(line)
    if engine_args.data_parallel_size > 1:          # replicas on Ray Serve (replicas/)
        engine = start_pool(engine_args, ray_address=engine_args.ray_address,
                            debug_check_consistency=server.debug_check_consistency)
    else:
        engine = AsyncEngine.from_engine_args(
            engine_args, debug_check_consistency=server.debug_check_consistency)
    return create_app(engine, served_model_name=engine_args.served_model_name,
                      api_key=server.api_key, metrics_require_auth=server.metrics_require_auth,
                      max_request_body_bytes=server.max_request_body_bytes,
                      model_root=engine_args.model, serving_config=serving_config), engine


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    omp_policy.apply(getattr(args, "omp_wait_policy", "env"))   # before torch loads libgomp

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
