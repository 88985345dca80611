"""The pooling endpoints: /v1/embeddings, /v1/score and /rerank over one embedding path.

Each input is its own pooling request (core.request.PoolingParams), added to the engine at
once so the scheduler batches them with everything else in flight, as prefill-only
requests: computed in chunks, pooled when the last prompt token is computed, finished there
with their KV blocks freed (model/pooler.py, core/scheduler.py). Inputs are run in a task
group: the first that fails cancels the rest (their requests are aborted and freed), and the
error is the answer.

/v1/score and /rerank on an embedding model are the cosine similarity of the embeddings of
the two sides (vLLM's rule for a model without a cross-encoder head). A server whose model
generates text answers these routes with a 400 (WrongRunnerError), and a pooling server
answers the generation routes the same way (the input processor).
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any, Callable, Sequence

import numpy as np
from fastapi import FastAPI

from iterserve.core.request import PoolingParams
from iterserve.errors import (InvalidRequestError, PromptTooLongError, ServerError,
                              WrongRunnerError)
from iterserve.server.errors import to_api_error
from iterserve.server.protocol import _TruncateFields
from iterserve.server.protocol_pooling import EmbeddingRequest, RerankRequest, ScoreRequest
from iterserve.server.serving_common import check_model


def _pooling_engine(engine: Any) -> Any:
    if getattr(engine, "pooler_config", None) is None:
        raise WrongRunnerError(
            "this model is served for text generation; embeddings, scores and reranking need "
            "an embedding model served with --runner pooling (or --convert embed)", "model")
    return engine


async def embed_all(engine: Any, inputs: Sequence[str | list[int]], params: PoolingParams, *,
                    add_special_tokens: bool = True, priority: int = 0, param: str = "input",
                    body: _TruncateFields | None = None) -> tuple[list[np.ndarray], int]:
    """The vectors of `inputs` (in order) and their prompt tokens in all; each input
    left-truncated where `body` sets truncate_prompt_tokens (vLLM's: the last k tokens)."""
    base = engine.next_request_id("embd")
    truncating = body is not None and body.truncate_prompt_tokens is not None

    async def one(i: int, x: str | list[int]) -> tuple[np.ndarray, int]:
        if isinstance(x, str):
            try:
                ids = await engine.tokenize(x, add_special_tokens=add_special_tokens,
                                            limit=None if truncating else engine.max_model_len)
            except PromptTooLongError as e:
                raise PromptTooLongError(f"{param}[{i}]: {e}", param) from None
        else:
            ids = x
        if truncating:
            ids = body.truncate(list(ids), engine.max_model_len)
        out = await engine.encode(ids, params, request_id=f"{base}-{i}", priority=priority)
        if out is None or out.embedding is None:
            raise ServerError(f"{param}[{i}] was not embedded: "
                              f"{(out.error if out is not None else None) or 'aborted'}")
        return out.embedding, len(out.prompt_token_ids)

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(i, x)) for i, x in enumerate(inputs)]
    except BaseExceptionGroup as eg:             # the first error is the answer
        raise eg.exceptions[0] from None
    results = [t.result() for t in tasks]
    return [v for v, _ in results], sum(n for _, n in results)


def _encode(v: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":                          # OpenAI's: little-endian float32 bytes
        return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
    return v.tolist()


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    return float(np.dot(a, b) / (na * nb)) if na and nb else 0.0


def install_pooling_api(app: FastAPI, require_engine: Callable[[], Any], model_name: Any
                        ) -> None:
    """The pooling routes on `app`."""

    def wrap(exc: Exception) -> Exception:
        return to_api_error(exc) or exc

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        try:
            check_model(body.model, model_name)
            e = _pooling_engine(require_engine())
            params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
            vecs, tokens = await embed_all(e, body.inputs(), params,
                                           add_special_tokens=body.add_special_tokens,
                                           priority=body.priority, body=body)
        except Exception as exc:
            raise wrap(exc) from exc
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": model_name,
                "data": [{"object": "embedding", "index": i,
                          "embedding": _encode(v, body.encoding_format)}
                         for i, v in enumerate(vecs)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def score(body: ScoreRequest) -> dict[str, Any]:
        try:
            check_model(body.model, model_name)
            e = _pooling_engine(require_engine())
            t1 = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
            t2 = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
            if len(t1) != 1 and len(t1) != len(t2):
                raise InvalidRequestError(
                    f"text_1 has {len(t1)} texts and text_2 {len(t2)}: give one text_1, or "
                    "as many as text_2", "text_1")
            vecs, tokens = await embed_all(e, t1 + t2, PoolingParams(),
                                           add_special_tokens=body.add_special_tokens,
                                           priority=body.priority, param="text", body=body)
        except Exception as exc:
            raise wrap(exc) from exc
        v1, v2 = vecs[:len(t1)], vecs[len(t1):]
        pairs = [(v1[0] if len(v1) == 1 else v1[i], v) for i, v in enumerate(v2)]
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": model_name,
                "data": [{"index": i, "object": "score", "score": _cosine(a, b)}
                         for i, (a, b) in enumerate(pairs)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def rerank(body: RerankRequest) -> dict[str, Any]:
        try:
            check_model(body.model, model_name)
            e = _pooling_engine(require_engine())
            vecs, tokens = await embed_all(e, [body.query, *body.documents], PoolingParams(),
                                           add_special_tokens=body.add_special_tokens,
                                           priority=body.priority, param="documents",
                                           body=body)
        except Exception as exc:
            raise wrap(exc) from exc
        q = vecs[0]
        scored = sorted(((_cosine(q, v), i) for i, v in enumerate(vecs[1:])),
                        key=lambda s: (-s[0], s[1]))
        if body.top_n:
            scored = scored[:body.top_n]
        results = []
        for s, i in scored:
            r: dict[str, Any] = {"index": i, "relevance_score": s}
            if body.return_documents:
                r["document"] = {"text": body.documents[i]}
            results.append(r)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": results}

    for path in ("/score", "/v1/score"):
        app.post(path, operation_id=f"score{path.replace('/', '_')}")(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path, operation_id=f"rerank{path.replace('/', '_')}")(rerank)
