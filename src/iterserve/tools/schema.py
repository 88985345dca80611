"""The arguments schema a forced call is generated under: no keys the schema did not name.

JSON Schema lets an object hold any key its `properties` do not name unless the schema says
`additionalProperties: false`, and llguidance follows the letter of that: a forced call on a
weak model then invents keys (`{"city": "Paris", "condition": ...}`) that a client's
function cannot take. vLLM's grammar backends generate only declared keys by default
(xgrammar's strict mode), and OpenAI's function schemas mean the same, so a forced call's
schema is closed here before it is compiled:

- every object schema that does not say what other keys may hold (no `additionalProperties`,
  `patternProperties` or `unevaluatedProperties`) gets `additionalProperties: false`; an
  object that says `additionalProperties: true` or gives a schema for them keeps it;
- with the function's `strict: true` (OpenAI's structured outputs), every object is closed
  whatever it says and every property it declares is required, as OpenAI's strict mode
  defines the output.

An object that combines subschemas with `allOf` is left open (its keys may be declared by
the branches, which closing each branch on its own would make unsatisfiable), and so are
the `allOf` branches themselves. The schema the client sent is never modified (the template
shows the tools as given); a closed copy is returned.
"""

from __future__ import annotations

from typing import Any

__all__ = ["closed_schema"]

# keywords whose value is one subschema / a list of them / a name -> subschema map
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "additionalProperties", "unevaluatedItems")
_MANY = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def _is_object_schema(s: dict[str, Any]) -> bool:
    t = s.get("type")
    return t == "object" or (isinstance(t, list) and "object" in t) or "properties" in s


def closed_schema(schema: Any, *, strict: bool = False) -> Any:
    """A copy of `schema` in which objects hold only the keys they declare (see above)."""
    return _close(schema, strict, in_all_of=False)


def _close(s: Any, strict: bool, *, in_all_of: bool) -> Any:
    if not isinstance(s, dict):
        return s
    out: dict[str, Any] = {}
    for key, value in s.items():
        if key in _ONE and isinstance(value, dict):
            out[key] = _close(value, strict, in_all_of=False)
        elif key in _MANY and isinstance(value, list):
            out[key] = [_close(v, strict, in_all_of=False) for v in value]
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_close(v, strict, in_all_of=True) for v in value]
        elif key in _MAP and isinstance(value, dict):
            out[key] = {k: _close(v, strict, in_all_of=False) for k, v in value.items()}
        else:
            out[key] = value
    if in_all_of or "allOf" in out or not _is_object_schema(out):
        return out
    if strict:
        out["additionalProperties"] = False
        out.pop("unevaluatedProperties", None)
        out.pop("patternProperties", None)
        props = out.get("properties")
        if isinstance(props, dict) and props:
            required = list(out.get("required") or [])
            out["required"] = required + [k for k in props if k not in required]
    elif not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out
