"""What a request asks its output to match: the torch-free description of a constraint.

`StructuredOutputsParams` holds exactly one constraint, in vLLM's vocabulary:

- `json`: a JSON schema (dict, or its JSON text)
- `json_object`: any JSON object (OpenAI's `response_format: {"type": "json_object"}`)
- `regex`: a regular expression the whole output must match (Rust `regex` syntax, as
  llguidance reads it; no look-around or back-references)
- `choice`: one of a list of strings (at most 1,024, as vLLM's `guided_choice` here)
- `grammar`: a context-free grammar in GBNF/EBNF (llama.cpp's `root ::= ...`) or in
  llguidance's Lark dialect (a grammar with a `start:` rule)

The request side builds it from OpenAI's `response_format`, vLLM's `structured_outputs`
extra, or vLLM's older `guided_*` fields (`from_request`). Everything here is plain data so
that `core/` (SamplingParams) may carry it without knowing about tensors or the grammar
engine; `structured.backend` compiles it.

Errors are `StructuredOutputsError` (a ValueError) with the request field in `param`, so the
server can answer 400 naming the field, the way `SamplingParamsError` does.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any, Mapping

from iterserve.errors import StructuredOutputsError



KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _renamed(exc: StructuredOutputsError, message: str, param: str | None
             ) -> StructuredOutputsError:
    """`exc` (its class and attributes kept: a limit error stays one) with a new message and
    param."""
    import copy
    e = copy.copy(exc)
    e.args = (message,)
    e.param = param
    return e


@dataclass(slots=True, eq=True)
class StructuredOutputsParams:
    """Exactly one of the five constraints; `disable_any_whitespace` forbids whitespace
    between JSON tokens (vLLM's flag of the same name)."""

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    # The request field the constraint came from ("response_format.json_schema.schema",
    # "guided_regex", ...): compile errors name it. Not part of the identity.
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    # --- checks -----------------------------------------------------------------------
    def validate(self, param: str = "structured_outputs") -> "StructuredOutputsParams":
        """Shape checks (one constraint, right types) and the O(1) limits (size, number of
        choices); the limits that need a scan (structured/limits.py) and the grammar engine
        check the content when it compiles (`StructuredOutputCompiler.compile`)."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputsError(
                f"{param} must set exactly one of {', '.join(KINDS)}; "
                + (f"got {', '.join(given)}" if given else "got none"), param)
        kind = given[0]
        value = getattr(self, kind)
        where = self.source or f"{param}.{kind}"
        if kind == "json":
            if isinstance(value, str):
                try:
                    parsed = _json.loads(value)
                except ValueError as exc:
                    raise StructuredOutputsError(
                        f"{where} is not valid JSON: {exc}", where) from None
                if not isinstance(parsed, (dict, bool)):
                    raise StructuredOutputsError(
                        f"{where} must be a JSON schema object, got {type(parsed).__name__}",
                        where)
            elif not isinstance(value, dict):
                raise StructuredOutputsError(
                    f"{where} must be a JSON schema (an object or its JSON text), "
                    f"got {type(value).__name__}", where)
        elif kind == "json_object":
            if value is not True:
                raise StructuredOutputsError(f"{where} must be true", where)
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value.strip():
                raise StructuredOutputsError(f"{where} must be a non-empty string", where)
        elif kind == "choice":
            if isinstance(value, tuple):
                self.choice = value = list(value)
            if (not isinstance(value, list) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise StructuredOutputsError(
                    f"{where} must be a non-empty list of non-empty strings", where)
            from iterserve.structured.limits import check_choices
            check_choices(where, value)         # O(1) count first: cheap on any thread
        if kind in ("regex", "grammar") or (kind == "json" and isinstance(value, str)):
            from iterserve.structured.limits import check_size
            check_size(where, value)
        if not isinstance(self.disable_any_whitespace, bool):
            raise StructuredOutputsError(
                f"{param}.disable_any_whitespace must be a boolean", f"{param}.disable_any_whitespace")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def value(self) -> Any:
        return getattr(self, self.kind)

    def cache_key(self) -> tuple:
        """Hashable identity of the constraint: equal specs share one compiled grammar."""
        value = self.value
        if self.kind == "json":
            if isinstance(value, str):
                value = _json.loads(value)
            value = _json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif self.kind == "choice":
            value = tuple(value)
        return (self.kind, value, self.disable_any_whitespace)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {self.kind: self.value}
        if self.disable_any_whitespace:
            d["disable_any_whitespace"] = True
        return d

    # --- request fields -----------------------------------------------------------------
    @classmethod
    def from_openai_response_format(cls, rf: Any, param: str = "response_format"
                                    ) -> "StructuredOutputsParams | None":
        """OpenAI's `response_format`: `{"type": "text"}` -> None, `json_object`, or
        `json_schema` with `{"name", "schema", "strict", "description"}`.

        `strict` is accepted either way: the schema is always enforced (as in vLLM). A
        `json_schema` without a `schema` means any JSON object, as OpenAI treats it.
        Accepts a dict or a pydantic model (anything with `model_dump`).
        """
        if rf is None:
            return None
        if hasattr(rf, "model_dump"):
            rf = rf.model_dump(exclude_none=True, by_alias=True)
        if not isinstance(rf, Mapping):
            raise StructuredOutputsError(f"{param} must be an object with a 'type'", param)
        kind = rf.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True, source=param)
        if kind == "json_schema":
            spec = rf.get("json_schema")
            where = f"{param}.json_schema"
            if not isinstance(spec, Mapping):
                raise StructuredOutputsError(
                    f"{where} is required when {param}.type is 'json_schema'", where)
            name = spec.get("name")
            if name is not None and not isinstance(name, str):
                raise StructuredOutputsError(f"{where}.name must be a string", f"{where}.name")
            strict = spec.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise StructuredOutputsError(f"{where}.strict must be a boolean",
                                             f"{where}.strict")
            schema = spec.get("schema", spec.get("schema_"))
            if schema is None:
                return cls(json_object=True, source=where)
            try:
                return cls(json=schema, source=f"{where}.schema")
            except StructuredOutputsError as exc:
                raise _renamed(exc, str(exc).replace("structured_outputs.json",
                                                     f"{where}.schema"),
                               f"{where}.schema") from None
        raise StructuredOutputsError(
            f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            f"{param}.type")

    @classmethod
    def from_structured_outputs(cls, so: Any, param: str = "structured_outputs"
                                ) -> "StructuredOutputsParams | None":
        """vLLM's `structured_outputs` extra: `{"json" | "regex" | "choice" | "grammar" |
        "json_object": ..., "disable_any_whitespace": bool}`. Keys vLLM has that are not
        implemented here (`structural_tag`, `whitespace_pattern`, ...) are refused by name."""
        if so is None:
            return None
        if isinstance(so, StructuredOutputsParams):
            return so
        if hasattr(so, "model_dump"):
            so = so.model_dump(exclude_none=True)
        if not isinstance(so, Mapping):
            raise StructuredOutputsError(f"{param} must be an object", param)
        known = set(KINDS) | {"disable_any_whitespace"}
        unsupported = {"structural_tag", "whitespace_pattern", "disable_fallback",
                       "disable_additional_properties"}
        for key in so:
            if key in unsupported:
                raise StructuredOutputsError(f"{param}.{key} is not supported", f"{param}.{key}")
            if key not in known:
                raise StructuredOutputsError(f"{param}.{key} is not a structured-output field "
                                             f"(known: {', '.join(sorted(known))})",
                                             f"{param}.{key}")
        kwargs = {k: v for k, v in so.items() if v is not None}
        kind = next((k for k in KINDS if kwargs.get(k) not in (None, False)), None)
        try:
            return cls(**kwargs, source=f"{param}.{kind}" if kind else param)
        except StructuredOutputsError as exc:
            raise _renamed(exc, str(exc), exc.param or param) from None

    @classmethod
    def from_request(cls, *, response_format: Any = None, structured_outputs: Any = None,
                     guided_json: Any = None, guided_regex: str | None = None,
                     guided_choice: list[str] | None = None, guided_grammar: str | None = None,
                     guided_json_object: bool | None = None,
                     guided_whitespace_pattern: str | None = None,
                     ) -> "StructuredOutputsParams | None":
        """The one constraint a request's fields ask for, or None. At most one source may be
        used: two (say `response_format` json_schema and `guided_regex`) are a 400."""
        sources: list[tuple[str, StructuredOutputsParams]] = []
        rf = cls.from_openai_response_format(response_format)
        if rf is not None:
            sources.append(("response_format", rf))
        so = cls.from_structured_outputs(structured_outputs)
        if so is not None:
            sources.append(("structured_outputs", so))
        if guided_whitespace_pattern is not None:
            raise StructuredOutputsError("guided_whitespace_pattern is not supported",
                                         "guided_whitespace_pattern")
        for name, kwargs in (("guided_json", {"json": guided_json}),
                             ("guided_regex", {"regex": guided_regex}),
                             ("guided_choice", {"choice": guided_choice}),
                             ("guided_grammar", {"grammar": guided_grammar}),
                             ("guided_json_object", {"json_object": guided_json_object or None})):
            if next(iter(kwargs.values())) is None:
                continue
            try:
                sources.append((name, cls(**kwargs, source=name)))
            except StructuredOutputsError as exc:
                raise _renamed(exc, str(exc).replace(
                    f"structured_outputs.{next(iter(kwargs))}", name), name) from None
        if len(sources) > 1:
            names = [n for n, _ in sources]
            raise StructuredOutputsError(
                f"only one structured-output constraint may be given; got {', '.join(names)}",
                names[1])
        return sources[0][1] if sources else None


def verify_row_id(req_id: str, position: int) -> str | tuple[str, int]:
    """The id of row `position` of a request's verification, for per-row data keyed by
    sequence (a grammar bitmask's rows): the request id itself for position 0 (the row a
    step without drafts would sample), (request id, position) after it."""
    return req_id if position == 0 else (req_id, position)
