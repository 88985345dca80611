"""The /lab page and its JSON endpoint: try to break the scheduler from a browser.

Everything here runs without a model: `POST /v1/lab/run` drives the lab (the engine's own
scheduler on a simulated executor), and the page is plain HTML/JS/CSS shipped in the package
(`server/static/`), so `iterserve lab --serve` works on a laptop with no weights and no
internet. When the app does have an engine, the page also polls `GET /v1/engine/stats`
(served by the app, not by this router) for its live view.

The options are validated by the lab's own pydantic model (`iterserve.lab.options.LabOptions`,
its scheduler fields generated from the knob schema in core/config.py), the same one the CLI
and `run_lab` use, so there is no second schema here to drift. The router checks that the body
is a JSON object, bounds the work, and maps `LabOptionsError` (which names the option) to an
OpenAI-style 400 body with `param`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse, Response

from iterserve.errors import LabOptionsError
from iterserve.lab.api import OPTION_DEFAULTS, run_lab
from iterserve.lab.cluster import run_cluster_lab
from iterserve.lab.options import presets_json
from iterserve.server.errors import error_response

router = APIRouter(tags=["lab"])

STATIC_DIR = Path(__file__).resolve().parent / "static"

# The files the page needs, by URL name. A fixed table (not a StaticFiles mount over the
# folder) so that nothing but these is ever served and no path can escape the folder.
_STATIC_FILES: dict[str, str] = {
    "lab.js": "text/javascript; charset=utf-8",
    "lab_cluster.js": "text/javascript; charset=utf-8",
    "lab.css": "text/css; charset=utf-8",
}

# The lab itself accepts CLI-sized runs (up to a million requests); over HTTP the same
# process may be serving a model, and a run holds a worker thread and the GIL while it
# simulates, so the endpoint bounds the work up front: requests x their longest possible
# output. The reference case is 48 x 500 = 24,000 tokens (~0.1 s); the bound allows 2,000
# requests of that mix (~4 s of simulation on one core and ~6 MB of per-request JSON), which
# is plenty for a what-if in the browser. The CLI has no such bound.
MAX_HTTP_OUTPUT_TOKENS = 1_000_000

# Lab options are a few dozen numbers (a `lengths` list at most a few thousand); a bigger
# body is a mistake or abuse, refused before it is parsed.
MAX_BODY_BYTES = 256 * 1024


def _error(status_code: int, message: str, *, param: str | None = None,
           code: str | None = None) -> JSONResponse:
    type_ = "not_found_error" if status_code == 404 else "invalid_request_error"
    return error_response(status_code, message, type=type_, param=param, code=code)


@router.get("/lab", include_in_schema=False)
async def lab_page() -> FileResponse:
    """The page itself; it loads /lab/static/lab.js and lab.css."""
    return FileResponse(STATIC_DIR / "lab.html", media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})


@router.get("/lab/static/{name}", include_in_schema=False)
async def lab_static(name: str) -> Response:
    media_type = _STATIC_FILES.get(name)
    if media_type is None:
        return _error(404, f"no lab static file named {name!r}", code="not_found")
    return FileResponse(STATIC_DIR / name, media_type=media_type,
                        headers={"Cache-Control": "no-cache"})


_JSON_TYPE_NAMES = {list: "an array", str: "a string", int: "a number", float: "a number",
                   bool: "a boolean", type(None): "null"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _work_bound_error(options: dict[str, Any]) -> JSONResponse | None:
    """400 when the run could simulate more than MAX_HTTP_OUTPUT_TOKENS output tokens.

    Only well-typed values are checked here; anything else is left to the lab, whose
    messages say what is wrong with it.
    """
    def opt(name: str) -> Any:
        v = options.get(name)
        return OPTION_DEFAULTS.get(name) if v is None else v

    lengths = opt("lengths")
    if isinstance(lengths, list) and all(_is_int(n) for n in lengths):
        total, param = sum(max(n, 0) for n in lengths), "lengths"
    else:
        requests = opt("requests")
        if not _is_int(requests):
            return None
        longest = 0
        for name in ("short", "long"):
            rng = opt(name)
            if isinstance(rng, (list, tuple)) and len(rng) == 2 and _is_int(rng[1]):
                longest = max(longest, rng[1])
        total, param = requests * longest, "requests"
    if total > MAX_HTTP_OUTPUT_TOKENS:
        return _error(400, f"{param}: this run could simulate up to {total:,} output tokens; "
                           f"the HTTP endpoint runs at most {MAX_HTTP_OUTPUT_TOKENS:,} "
                           "(fewer requests or shorter outputs; `iterserve lab` has no such "
                           "limit)", param=param, code="lab_run_too_large")
    return None


@router.post("/v1/lab/run")
async def lab_run(request: Request) -> Response:
    """Run the lab with the JSON body as options; return its result JSON.

    400 for a body that is not a JSON object or options the lab rejects. The simulation is
    CPU work, so it runs in the thread pool and the event loop keeps serving (a real engine
    in the same process keeps streaming tokens meanwhile).
    """
    return await _run_options(request, run_lab, _work_bound_error)


async def _run_options(request: Request, run: Any, work_bound_error: Any) -> Response:
    """The body rules both lab endpoints share: a JSON object of options (400 otherwise),
    refused when `work_bound_error` says it is too much work for HTTP, then `run(options)`
    on the thread pool; LabOptionsError -> 400 naming the option."""
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        return _error(400, f"request body is {len(raw)} bytes; the lab accepts at most "
                           f"{MAX_BODY_BYTES}")
    if raw.strip():
        try:
            options: Any = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, f"request body is not valid JSON: {exc}")
    else:
        options = {}
    if not isinstance(options, dict):
        return _error(400, "request body must be a JSON object of lab options, got "
                           + _JSON_TYPE_NAMES.get(type(options), type(options).__name__))
    too_big = work_bound_error(options)
    if too_big is not None:
        return too_big
    try:
        result = await run_in_threadpool(run, options)
    except LabOptionsError as exc:
        # `option` lets the page mark the field; the message names it in any case.
        return _error(400, str(exc), param=getattr(exc, "option", None),
                      code="invalid_lab_option")
    return JSONResponse(result)


# --- the cluster view (lab/cluster.py) ---------------------------------------------------
# A cluster run simulates every replica's steps, so its work is the same requests x output
# tokens as a single run, spread over replicas; a search repeats the run (up to
# CLUSTER_SEARCH_RUNS times), so its bound counts every repeat.
MAX_HTTP_CLUSTER_TOKENS = 2_000_000
CLUSTER_SEARCH_RUNS = 14


def _cluster_work_bound_error(options: dict[str, Any]) -> JSONResponse | None:
    def opt(name: str, default: Any) -> Any:
        v = options.get(name)
        return default if v is None else v

    requests = opt("requests", OPTION_DEFAULTS["requests"])
    if not _is_int(requests):
        return None
    longest = 0
    for name in ("short", "long"):
        rng = opt(name, OPTION_DEFAULTS[name])
        if isinstance(rng, (list, tuple)) and len(rng) == 2 and _is_int(rng[1]):
            longest = max(longest, rng[1])
    runs = CLUSTER_SEARCH_RUNS if options.get("search") is not None else 1
    total = requests * longest * runs
    if total > MAX_HTTP_CLUSTER_TOKENS:
        return _error(400, f"requests: this cluster run could simulate up to {total:,} output "
                           f"tokens{' over its search' if runs > 1 else ''}; the HTTP endpoint "
                           f"runs at most {MAX_HTTP_CLUSTER_TOKENS:,} (fewer requests or "
                           "shorter outputs; `iterserve lab --replicas N` has no such limit)",
                      param="requests", code="lab_run_too_large")
    return None


@router.post("/v1/lab/cluster")
async def lab_cluster(request: Request) -> Response:
    """The cluster lab (N replicas behind the server's router) with the JSON body as
    options: `run_cluster_lab`'s result. Same body rules and error shape as /v1/lab/run;
    `cost_model` may also be the name of a shipped cost model (never a file path)."""
    return await _run_options(request, run_cluster_lab, _cluster_work_bound_error)


@router.get("/v1/lab/presets")
async def lab_presets() -> dict[str, Any]:
    """The lab's named option sets (lab/options.py PRESETS): the page fills its form from
    them; `POST /v1/lab/run` takes {"preset": name, ...overrides}."""
    return presets_json()
