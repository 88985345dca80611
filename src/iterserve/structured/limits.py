"""The documented limits on a constraint, checked before the grammar engine sees it.

Why: llguidance builds its lexer and Earley parser lazily, so a constraint that is valid but
huge does not fail when it compiles; it fails (or burns seconds of CPU, or overflows the
compiling thread's stack) later, at the first mask or at a token. Measured on the bundled
model's 49,152-token vocabulary (2 loaded cores):

- `(x{1000}){1000}` and `((a{100}){100}){100}`: 4-11 s for the first mask, then "too many
  expressions constructed" at the first token; `(x{100}){100}` (10,000) takes 0.4 s,
  `x{5000}` 0.2 s;
- a 20,000-item choice or a 30,000-literal Lark alternation: "Current row has 20001 items;
  max is 2000" at the first token (an Earley row holds every alternative);
- an object schema with 10,000 properties: 55 s for 20 tokens (1,000: 0.3 s; 2,000: 1.2 s);
- an `anyOf` of 5,000 branches: the same row limit (1,900 branches: 0.8 s);
- a chain of 3,500 Lark rules: a stack overflow of an 8 MiB thread (a segfault: every
  stream lost), 30,000 need 256 MiB.

So these limits hold, and each refusal is a 400 naming the limit (`ConstraintLimitError`):

| limit | value | what counts |
|---|---|---|
| MAX_CONSTRAINT_BYTES | 256 KiB | the regex, the grammar, the schema's JSON, all choices together |
| MAX_CHOICES | 1,024 | `choice` items (as `guided_choice`) |
| MAX_GRAMMAR_RULES | 2,000 | rule and terminal definitions of a Lark / GBNF grammar |
| MAX_ALTERNATIVES | 1,024 | `\\|` alternatives in one grammar rule; `anyOf` / `oneOf` / `allOf` branches |
| MAX_NESTING | 64 | parentheses in a regex or a rule; the depth of a schema's objects and arrays |
| MAX_REPEAT | 1,000 | one counted repetition's bound: `{m,n}`, Lark's `x~n..m` |
| MAX_REPEAT_PRODUCT | 10,000 | nested counted repetitions multiplied (`(a{100}){100}` = 10,000) |
| MAX_PROPERTIES | 1,000 | `properties` of one object schema |

A schema's `pattern` / `patternProperties` and a grammar's `/regex/` literals are regexes and
are checked as such; `%json { ... }` inside a Lark grammar is checked as a schema. Unbounded
repetition (`*`, `+`, JSON Schema's `minLength` / `maxItems`...) is not limited: llguidance
handles it lazily (a 1,000,000-character `minLength` costs ~1 ms a token).

The checks are pure Python and linear in the text; they run on the compile worker (a 256 KiB
grammar takes ~0.1 s), never on the event loop or the engine thread.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator

from iterserve.errors import ConstraintTooComplexError

MAX_CONSTRAINT_BYTES = 256 << 10
MAX_CHOICES = 1024
MAX_GRAMMAR_RULES = 2000
MAX_ALTERNATIVES = 1024
MAX_NESTING = 64
MAX_REPEAT = 1000
MAX_REPEAT_PRODUCT = 10_000
MAX_PROPERTIES = 1000


class ConstraintLimitError(ConstraintTooComplexError):
    """A constraint over one of the documented limits (HTTP 400, code
    `constraint_too_complex`); `limit` names it."""
    def __init__(self, message: str, param: str | None = None, limit: str | None = None):
        super().__init__(message, param)
        self.limit = limit


def _refuse(where: str, limit: str, what: str, value: int, maximum: int) -> None:
    raise ConstraintLimitError(
        f"{where}: {what} is {value:,}; the limit is {maximum:,} ({limit}, see the README's "
        "structured outputs section)", where, limit)


def check_size(where: str, text: str) -> None:
    n = len(text.encode("utf-8", "surrogatepass")) if not text.isascii() else len(text)
    if n > MAX_CONSTRAINT_BYTES:
        _refuse(where, "MAX_CONSTRAINT_BYTES", "the constraint's size in bytes", n,
                MAX_CONSTRAINT_BYTES)


def check_choices(where: str, choices: list[str]) -> None:
    if len(choices) > MAX_CHOICES:
        _refuse(where, "MAX_CHOICES", "the number of choices", len(choices), MAX_CHOICES)
    check_size(where, "".join(choices))


# --- repetition bookkeeping shared by regexes and grammars ----------------------------------

class _Frames:
    """Groups being read, innermost last. Each holds the largest product of counted
    repetitions seen inside it; a closed group becomes an atom of that weight, and a
    quantifier after an atom multiplies its weight."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.stack: list[int] = [1]
        self.atom = 0               # weight of the atom a quantifier would apply to (0: none)

    def _settle(self) -> None:
        if self.atom:
            self.stack[-1] = max(self.stack[-1], self.atom)

    def atom_(self) -> None:
        self._settle()
        self.atom = 1

    def open(self) -> None:
        self._settle()
        self.atom = 0
        self.stack.append(1)
        if len(self.stack) - 1 > MAX_NESTING:
            _refuse(self.where, "MAX_NESTING", "the nesting depth of groups",
                    len(self.stack) - 1, MAX_NESTING)

    def close(self) -> None:
        self._settle()
        inner = self.stack.pop() if len(self.stack) > 1 else 1
        self.atom = inner

    def bar(self) -> None:
        self._settle()
        self.atom = 0

    def repeat(self, bound: int) -> None:
        if bound > MAX_REPEAT:
            _refuse(self.where, "MAX_REPEAT", "a counted repetition's bound", bound, MAX_REPEAT)
        if not self.atom:
            return                  # nothing to repeat: the engine reports the syntax
        self.atom *= max(bound, 1)
        if self.atom > MAX_REPEAT_PRODUCT:
            _refuse(self.where, "MAX_REPEAT_PRODUCT",
                    "the product of nested counted repetitions", self.atom, MAX_REPEAT_PRODUCT)

    def end(self) -> None:
        self._settle()


_COUNTED = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _bound(m: re.Match) -> int:
    lo, hi = m.group(1), m.group(2)
    return int(hi) if hi else int(lo)


def check_regex(where: str, pattern: str) -> None:
    """Nesting and counted repetitions of a regex in Rust `regex` syntax (llguidance's)."""
    check_size(where, pattern)
    f = _Frames(where)
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            j = i + 2
            if i + 1 < n and pattern[i + 1] in "pPxuU" and j < n and pattern[j] == "{":
                k = pattern.find("}", j)
                j = n if k < 0 else k + 1
            f.atom_()
            i = j
        elif c == "[":
            i = _skip_class(pattern, i)
            f.atom_()
        elif c == "(":
            f.open()
            i += 1
        elif c == ")":
            f.close()
            i += 1
        elif c == "|":
            f.bar()
            i += 1
        elif c == "{":
            m = _COUNTED.match(pattern, i)
            if m:
                f.repeat(_bound(m))
                i = m.end()
            else:
                f.atom_()
                i += 1
        elif c in "*+?":
            i += 1                  # unbounded or optional: no multiplication
        else:
            f.atom_()
            i += 1
    f.end()


def _skip_class(s: str, i: int) -> int:
    """The index after the character class starting at s[i] == '[' (nested classes, escapes
    and a leading ']' or '^]' as Rust reads them)."""
    n = len(s)
    depth = 0
    j = i
    while j < n:
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == "[":
            depth += 1
            j += 1
            if j < n and s[j] == "^":
                j += 1
            if j < n and s[j] == "]":
                j += 1              # a literal ']' first in the class
            continue
        if c == "]":
            depth -= 1
            j += 1
            if depth == 0:
                return j
            continue
        j += 1
    return n


# --- grammars (Lark, as llguidance reads it, and GBNF) ---------------------------------------

_GRAMMAR_TOKEN = re.compile(r"""
    (?P<nl>\n)
  | (?P<ws>[ \t\r\f]+)
  | (?P<comment>//[^\n]*|\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?|'(?:[^'\\\n]|\\.)*')
  | (?P<regex>/(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<json>%json\s*\{)
  | (?P<define>::=|:)
  | (?P<tilde>~\s*\d+(?:\s*\.\.\s*\d+)?)
  | (?P<counted>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<open>[(\[])
  | (?P<close>[)\]])
  | (?P<bar>\|)
  | (?P<name>[!?]?[A-Za-z_][A-Za-z0-9_.-]*)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)


def _tokens(text: str) -> Iterator[re.Match]:
    return _GRAMMAR_TOKEN.finditer(text)


def check_grammar(where: str, text: str) -> None:
    """Rules, alternatives per rule, nesting and counted repetitions of a Lark or GBNF
    grammar; its regex literals as regexes, its `%json` blocks as schemas."""
    check_size(where, text)
    rules = 0
    alternatives = 1
    line_start = True
    pending_name = False            # a name first on its line: a definition if ':' follows
    f = _Frames(where)
    tokens = _tokens(text)
    for m in tokens:
        kind = m.lastgroup
        if kind == "nl":
            line_start = True
            pending_name = False
            continue
        if kind in ("ws", "comment"):
            continue
        first_on_line, line_start = line_start, False
        if kind == "define" and pending_name:
            rules += 1
            if rules > MAX_GRAMMAR_RULES:
                _refuse(where, "MAX_GRAMMAR_RULES", "the number of rules", rules,
                        MAX_GRAMMAR_RULES)
            alternatives = 1
            f.end()
            f = _Frames(where)
            pending_name = False
            continue
        pending_name = kind == "name" and first_on_line
        if kind == "name" or kind == "string":
            f.atom_()
        elif kind == "regex":
            body = m.group()
            check_regex(where, body[1:body.rindex("/")])
            f.atom_()
        elif kind == "json":
            end = _json_block_end(text, m.end() - 1)
            block = text[m.end() - 1:end]
            try:
                schema = json.loads(block)
            except ValueError:
                schema = None           # the engine reports the syntax
            if schema is not None:
                check_schema(where, schema)
            f.atom_()
            for m2 in tokens:           # skip the block
                if m2.end() >= end:
                    break
        elif kind == "open":
            f.open()
        elif kind == "close":
            f.close()
        elif kind == "bar":
            alternatives += 1
            if alternatives > MAX_ALTERNATIVES:
                _refuse(where, "MAX_ALTERNATIVES", "the number of alternatives in one rule",
                        alternatives, MAX_ALTERNATIVES)
            f.bar()
        elif kind == "tilde":
            f.repeat(int(re.findall(r"\d+", m.group())[-1]))
        elif kind == "counted":
            f.repeat(_bound(_COUNTED.match(m.group())))
    f.end()


def _json_block_end(text: str, start: int) -> int:
    """The index after the JSON object starting at text[start] == '{' (strings skipped)."""
    depth = 0
    i, n = start, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


# --- JSON schemas ---------------------------------------------------------------------------

def check_schema(where: str, schema: Any, *, size_checked: bool = False) -> None:
    """Depth, properties per object, branches per anyOf / oneOf / allOf, and the regexes
    (`pattern`, `patternProperties`) of a JSON schema."""
    if not size_checked:
        check_size(where, json.dumps(schema, ensure_ascii=False, separators=(",", ":")))
    stack: list[tuple[Any, int]] = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            _refuse(where, "MAX_NESTING", "the schema's nesting depth", depth, MAX_NESTING)
        if isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
            continue
        if not isinstance(node, dict):
            continue
        props = node.get("properties")
        if isinstance(props, dict) and len(props) > MAX_PROPERTIES:
            _refuse(where, "MAX_PROPERTIES", "the number of properties of one object",
                    len(props), MAX_PROPERTIES)
        for key in ("anyOf", "oneOf", "allOf"):
            branches = node.get(key)
            if isinstance(branches, list) and len(branches) > MAX_ALTERNATIVES:
                _refuse(where, "MAX_ALTERNATIVES", f"the number of {key} branches",
                        len(branches), MAX_ALTERNATIVES)
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            check_regex(where, pattern)
        pp = node.get("patternProperties")
        if isinstance(pp, dict):
            for p in pp:
                check_regex(where, p)
        for key, value in node.items():
            if key == "enum" or key == "const":
                continue            # values, not schemas
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1))


def check(params: Any, where: str) -> None:
    """Every limit that applies to `params` (a StructuredOutputsParams)."""
    kind, value = params.kind, params.value
    if kind == "regex":
        check_regex(where, value)
    elif kind == "grammar":
        check_grammar(where, value)
    elif kind == "choice":
        check_choices(where, value)
    elif kind == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        if isinstance(value, str):
            check_size(where, value)
        check_schema(where, schema, size_checked=isinstance(value, str))
