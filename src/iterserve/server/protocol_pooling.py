"""Request bodies of the pooling endpoints: /v1/embeddings (OpenAI's), /v1/score and
/rerank (vLLM's, Jina's and Cohere's shape), strict like every body of protocol.py (unknown
fields are a 400 naming them, limits are constraints the published schema states)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from iterserve.server.protocol import MAX_PRIORITY, MAX_TOKEN_ID, Text, _Model, _TruncateFields

MAX_INPUTS = 2048          # OpenAI's cap on inputs per embeddings request
MAX_DOCUMENTS = 1024       # documents per rerank / score request

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class EmbeddingRequest(_TruncateFields):
    """OpenAI's embeddings body (`input`: a string, strings, token ids or lists of token
    ids; `encoding_format`; `dimensions`; `user` a no-op), with vLLM's `add_special_tokens`,
    `normalize`, `priority` and `truncate_prompt_tokens` (each input's last k tokens)."""

    model: Text | None = None
    input: Text | TokenIds | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)] \
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: Text | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: Annotated[int, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] = 0

    @field_validator("input")
    @classmethod
    def _no_empty_text(cls, v):
        texts = [v] if isinstance(v, str) else [x for x in v if isinstance(x, str)]
        if any(not t for t in texts):
            raise ValueError("input must not contain an empty string")
        return v

    def inputs(self) -> list[str | list[int]]:
        """One prompt per embedding, in order."""
        v = self.input
        if isinstance(v, str):
            return [v]
        if v and isinstance(v[0], int):
            return [list(v)]
        return list(v)


_Texts = Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_DOCUMENTS)]


class ScoreRequest(_TruncateFields):
    """vLLM's /score: `text_1` against `text_2` (one against many, or pairwise lists of the
    same length); an embedding model scores by the cosine similarity of the embeddings."""

    model: Text | None = None
    text_1: _Texts
    text_2: _Texts
    add_special_tokens: bool = True
    priority: Annotated[int, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] = 0
    user: Text | None = None


class RerankRequest(_TruncateFields):
    """vLLM's /rerank (Jina's and Cohere's body): the documents ordered by their relevance
    to the query, the best `top_n` (0 or missing: all)."""

    model: Text | None = None
    query: Text
    documents: Annotated[list[Text], Field(min_length=1, max_length=MAX_DOCUMENTS)]
    top_n: Annotated[int, Field(ge=0)] | None = None
    return_documents: bool = True
    add_special_tokens: bool = True
    priority: Annotated[int, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] = 0
    user: Text | None = None
