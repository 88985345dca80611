"""`iterserve serve`: load a model and serve the OpenAI-compatible API with uvicorn.

With no --model it serves the bundled default model on 127.0.0.1:8000 (`make serve`).
uvicorn handles SIGINT/SIGTERM: it stops accepting connections, gives in-flight responses
`--shutdown-timeout` seconds to finish, then cancels them (which aborts their requests),
and the app's lifespan shuts the engine down.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys


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
                   help="require 'Authorization: Bearer <key>' on /v1/ routes")
    g.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds in-flight requests may run on after SIGINT/SIGTERM")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def build_app(args: argparse.Namespace):
    from iterserve.engine.args import EngineArgs
    from iterserve.engine.async_engine import AsyncEngine
    from iterserve.server.app import create_app

    engine_args = EngineArgs.from_cli_args(args)
    engine = AsyncEngine.from_engine_args(engine_args)
    return create_app(engine, served_model_name=engine_args.served_model_name,
                      api_key=args.api_key), engine


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from iterserve.core.config import ConfigError

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app, engine = build_app(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"iterserve serve: {e}", file=sys.stderr)
        return 2
    e = engine.engine
    cache = getattr(e, "cache_config", None)
    print(f"iterserve: serving {e.model_name!r} on http://{args.host}:{args.port} "
          f"(max_model_len {e.max_model_len}"
          + (f", {cache.num_kv_blocks} KV blocks of {cache.block_size} tokens" if cache else "")
          + ")", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    server = DrainingServer(config, engine, drain_timeout=args.shutdown_timeout)

    # uvicorn re-raises the signal that stopped it once it is done; by then the shutdown
    # is complete, so exit 0 instead of dying by that signal.
    def _exit_cleanly(signum, frame):
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


class DrainingServer:
    """uvicorn.Server whose shutdown first stops accepting, then lets in-flight requests
    finish for `drain_timeout` seconds and aborts the rest in the engine, so every open
    stream ends with a final SSE event and `[DONE]` instead of a cut connection."""

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
