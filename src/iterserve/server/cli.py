"""`iterserve serve`: load a model and serve the OpenAI-compatible API with uvicorn.

With no --model it serves the bundled default model on 127.0.0.1:8000 (`make serve`).
uvicorn handles SIGINT/SIGTERM: it stops accepting connections, gives in-flight responses
`--shutdown-timeout` seconds to finish, then cancels them (which aborts their requests),
and the app's lifespan shuts the engine down. Every flag is a knob of core/config.py (the
server's and the OpenAI frontend's configs, then EngineArgs's), generated from there.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass

import yaml

from iterserve import envs
from iterserve.core.config import (
    SERVER_CONFIGS, FrontendConfig, ServerConfig, add_config_arguments, config_from,
    knob_notices)
from iterserve.engine import omp_policy
from iterserve.engine.args import EngineArgs
from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.metrics import LoggingStatLogger
from iterserve.errors import ConfigError, RayExposedError, RayNotInstalledError
from iterserve.replicas import close_pool, start_pool
from iterserve.server import http_options
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
    p.add_argument("--config", metavar="FILE", default=None,
                   help="read flags from a YAML file, as vLLM does: each key is a flag's name "
                        "(max-model-len: 4096, enable-prefix-caching: true); flags on the "
                        "command line win")
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
        sampling_defaults=load_generation_defaults(f.generation_config, model,
                                                   f.override_generation_config),
        log_requests=f.enable_log_requests, max_log_len=f.max_log_len,
        content_format=f.chat_template_content_format,
        default_chat_template_kwargs=f.default_chat_template_kwargs or {},
        response_role=f.response_role,
        exclude_tools_when_tool_choice_none=f.exclude_tools_when_tool_choice_none,
        prompt_tokens_details=f.enable_prompt_tokens_details,
        force_include_usage=f.enable_force_include_usage,
        reasoning_parser=f.reasoning_parser)


def expand_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--config FILE` (vLLM's): the YAML file's keys become flags placed before the
    command line's own, so a flag given on the command line wins. A key is a flag's name
    (dashes or underscores); true is the flag itself, false its --no- form, a list one
    value per item (`served-model-name: [a, b]`), a mapping its JSON (`pooler-config:
    {pooling_type: MEAN}`). `model` is the positional MODEL when the command line has none."""
    path = None
    rest: list[str] = []
    it = iter(argv)
    for a in it:
        if a == "--config":
            path = next(it, None)
            if path is None:
                raise ValueError("--config needs a FILE")
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
        else:
            rest.append(a)
    if path is None:
        return argv
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must be a YAML mapping of flag names to values")
    actions = {s: a for a in parser._actions for s in a.option_strings}
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag in ("--model", "--model-tag"):
            if not _has_positional_model(rest, actions) and "--model" not in rest:
                out += ["--model", str(value)]
            continue                                  # the command line's model wins
        if flag == "--config":
            raise ValueError(f"--config {path}: a config file cannot name another one")
        action = actions.get(flag)
        if action is None:
            raise ValueError(f"--config {path}: unknown option {key!r} (no flag {flag})")
        if isinstance(value, bool):
            if value:
                out.append(flag)
            elif isinstance(action, argparse.BooleanOptionalAction):
                out.append("--no-" + flag[2:])
            elif not isinstance(action, argparse._StoreFalseAction):
                raise ValueError(f"--config {path}: {key} takes a value, not false")
        elif value is None:
            continue
        elif getattr(action.type, "__name__", "") == "JSON":
            out += [flag, json.dumps(value)]
        elif isinstance(value, list):
            if isinstance(action, argparse._AppendAction):
                for v in value:
                    out += [flag, str(v)]
            elif action.nargs in ("+", "*"):
                out += [flag, *map(str, value)]
            else:
                raise ValueError(f"--config {path}: {key} takes one value, not a list")
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out + rest


def _has_positional_model(argv: list[str], actions: dict[str, argparse.Action]) -> bool:
    """Whether the command line (after `serve`) names MODEL itself."""
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a.startswith("-"):
            action = actions.get(a.split("=", 1)[0])
            skip = "=" not in a and action is not None and action.nargs != 0 \
                and not isinstance(action, (argparse.BooleanOptionalAction,
                                            argparse._StoreTrueAction,
                                            argparse._StoreFalseAction))
            continue
        return True
    return False


@dataclass
class Launch:
    """A serve command line checked before anything loads: every refused flag has failed
    (ConfigError naming it), and `notices` are the start-up lines for flags accepted without
    effect here."""

    engine_args: EngineArgs
    server: ServerConfig
    serving_config: ServingConfig
    notices: list[str]


def prepare_launch(args: argparse.Namespace) -> Launch:
    resolve_model_args(args)
    engine_args = EngineArgs.from_cli_args(args)
    server = config_from(ServerConfig, vars(args))
    frontend = config_from(FrontendConfig, vars(args))
    serving_config = serving_config_from_args(args, engine_args.model)
    load = engine_args.create_load_config()     # a refused flag fails before the model loads
    engine_args.create_scheduler_config()
    engine_args.create_parallel_config()
    notices = knob_notices(server, frontend, engine_args) + load.structured_outputs_notices()
    return Launch(engine_args, server, serving_config, notices)


def build_app(args: argparse.Namespace):
    # fastapi: for `serve` only (`iterserve --help` builds every subcommand's parser)
    from iterserve.server.app import create_app

    launch = prepare_launch(args)
    engine_args, server = launch.engine_args, launch.server
    for line in launch.notices:
        logger.warning(line)
    if engine_args.data_parallel_size > 1:          # replicas on Ray Serve (replicas/)
        engine = start_pool(engine_args, ray_address=engine_args.ray_address,
                            debug_check_consistency=server.debug_check_consistency)
    else:
        engine = AsyncEngine.from_engine_args(
            engine_args, debug_check_consistency=server.debug_check_consistency)
    # the stats line is INFO: below that level there is nothing to write, so no logger
    if not engine_args.disable_log_stats and logging.getLogger("iterserve.stats") \
            .isEnabledFor(logging.INFO):
        engine.add_stat_logger(LoggingStatLogger())
    app = create_app(engine, served_model_name=engine_args.served_model_names or None,
                     api_key=server.api_key, metrics_require_auth=server.metrics_require_auth,
                     max_request_body_bytes=server.max_request_body_bytes,
                     model_root=engine_args.model, serving_config=launch.serving_config)
    http_options.install(app, server)
    return app, engine


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    omp_policy.apply(getattr(args, "omp_wait_policy", "env"))   # before torch loads libgomp
    try:
        app, engine = build_app(args)
    except (ConfigError, ValueError, FileNotFoundError, RayNotInstalledError,
            RayExposedError) as e:
        print(f"iterserve serve: {e}", file=sys.stderr)
        return 2
    server_config = config_from(ServerConfig, vars(args))
    print(f"iterserve: serving {engine.model_name!r} on {http_options.address(server_config)} "
          f"(max_model_len {engine.max_model_len})", file=sys.stderr, flush=True)
    # After the drain (DrainingServer) every stream ends within a step or two; uvicorn's own
    # graceful wait only covers responses still being written.
    config = uvicorn.Config(app, log_level=args.uvicorn_log_level or args.log_level,
                            timeout_graceful_shutdown=0.5,
                            **http_options.uvicorn_options(server_config))
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
