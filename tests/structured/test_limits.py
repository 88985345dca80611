"""The documented constraint limits (structured/limits.py): refused before compiling, with a
400-style error naming the limit; what is inside them compiles; what passes the limits but
overruns the engine at its first token is refused at compile time too (the probe); and the
compile threads have the stack that a deep grammar needs."""

import json
import os
import subprocess
import sys

import pytest

from iterserve.errors import StructuredOutputsError
from iterserve.structured import StructuredOutputsParams as P
from iterserve.structured import limits
from iterserve.structured.limits import ConstraintLimitError


def _chain(n):
    """A Lark grammar that is a chain of n rules (start: r1, r1: r2, ...)."""
    return "\n".join(["start: r1"] + [f"r{i}: r{i + 1}" for i in range(1, n)] + [f'r{n}: "a"'])


@pytest.mark.parametrize("check,text,limit", [
    (limits.check_regex, "((a{100}){100}){100}", "MAX_REPEAT_PRODUCT"),
    (limits.check_regex, "(x{1000}){1000}", "MAX_REPEAT_PRODUCT"),
    (limits.check_regex, "x{1001}", "MAX_REPEAT"),
    (limits.check_regex, "(?:ab){2,5000}", "MAX_REPEAT"),
    (limits.check_regex, "(" * 65 + "a" + ")" * 65, "MAX_NESTING"),
    (limits.check_regex, "a" * (257 << 10), "MAX_CONSTRAINT_BYTES"),
    (limits.check_grammar, _chain(3500), "MAX_GRAMMAR_RULES"),
    (limits.check_grammar, "start: " + " | ".join(f'"w{i}"' for i in range(30000)),
     "MAX_CONSTRAINT_BYTES"),
    (limits.check_grammar, "start: " + " | ".join(f'"{i}"' for i in range(1025)),
     "MAX_ALTERNATIVES"),
    (limits.check_grammar, 'start: ("a"~100)~101', "MAX_REPEAT_PRODUCT"),
    (limits.check_grammar, 'start: "a"{2000}', "MAX_REPEAT"),
    (limits.check_grammar, "start: /(x{1000}){1000}/", "MAX_REPEAT_PRODUCT"),
    (limits.check_grammar, 'root ::= item{5000}\nitem ::= "a"', "MAX_REPEAT"),
    (limits.check_grammar, 'start: %json {"type": "string", "pattern": "(x{200}){200}"}',
     "MAX_REPEAT_PRODUCT"),
])
def test_text_limits_name_the_limit(check, text, limit):
    with pytest.raises(ConstraintLimitError) as e:
        check("structured_outputs.x", text)
    assert e.value.limit == limit and limit in str(e.value)
    assert e.value.param == "structured_outputs.x" and e.value.code == "constraint_too_complex"


@pytest.mark.parametrize("check,text", [
    (limits.check_regex, r"\d{3}-\d{4}"),
    (limits.check_regex, "(x{100}){100}"),
    (limits.check_regex, r"[{}a-z]{0,1000}\p{L}{2}\x{41}"),
    (limits.check_regex, r"[]a]{5}[^]]{3}[a-z&&[^x]]{2}"),
    (limits.check_regex, "a{,3}b{"),                 # not repetitions: the engine decides
    (limits.check_grammar, _chain(1999)),             # 2,000 rules with start
    (limits.check_grammar, "start: " + " | ".join(f'"{i}"' for i in range(1024))),
    (limits.check_grammar, 'start: "a"~1000 | ("b"~10)~1000\n// {99999}\nX: /[a-z]{1,50}/'),
    (limits.check_grammar, 'root ::= "x"{1000} ("|" [a-z])*  # "{5000}"'),
])
def test_within_the_limits(check, text):
    check("structured_outputs.x", text)


def test_schema_limits():
    where = "response_format.json_schema.schema"
    many = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1001)}}
    deep = {"type": "integer"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    for schema, limit in [
            (many, "MAX_PROPERTIES"),
            ({"anyOf": [{"const": i} for i in range(1025)]}, "MAX_ALTERNATIVES"),
            ({"type": "string", "pattern": "(x{1000}){1000}"}, "MAX_REPEAT_PRODUCT"),
            ({"type": "object", "patternProperties": {"a{5000}": {}}}, "MAX_REPEAT"),
            (deep, "MAX_NESTING")]:
        with pytest.raises(ConstraintLimitError) as e:
            limits.check_schema(where, schema)
        assert e.value.limit == limit, schema
    # values are not schemas; a big unbounded length is fine (llguidance is lazy there)
    limits.check_schema(where, {"enum": [{"properties": {str(i): 1 for i in range(2000)}}]})
    limits.check_schema(where, {"type": "string", "minLength": 1_000_000})


def test_choice_cap_is_checked_when_the_params_are_built():
    with pytest.raises(ConstraintLimitError, match="MAX_CHOICES") as e:
        P.from_structured_outputs({"choice": [f"item{i}" for i in range(20000)]})
    assert e.value.param == "structured_outputs.choice"
    P.from_structured_outputs({"choice": [f"item{i}" for i in range(1024)]})
    with pytest.raises(ConstraintLimitError, match="MAX_CONSTRAINT_BYTES"):
        P(grammar='start: "' + "a" * (300 << 10) + '"')


# --- through the compiler --------------------------------------------------------------------

@pytest.mark.parametrize("params,limit", [
    (P(regex="((a{100}){100}){100}"), "MAX_REPEAT_PRODUCT"),
    (P(regex="(x{1000}){1000}"), "MAX_REPEAT_PRODUCT"),
    (P(grammar=_chain(3500)), "MAX_GRAMMAR_RULES"),
    (P(json={"type": "object",
             "properties": {f"p{i}": {"type": "integer"} for i in range(1500)}}),
     "MAX_PROPERTIES"),
])
def test_compiler_refuses_over_the_limits(compiler, params, limit):
    with pytest.raises(StructuredOutputsError, match=limit) as e:
        compiler.compile(params, timeout=60)
    assert e.value.code == "constraint_too_complex"
    # refused from the cache the second time, still naming the limit
    with pytest.raises(StructuredOutputsError, match=limit):
        compiler.compile(params, timeout=60)


def test_a_large_choice_compiles_as_one_lexeme(compiler, tiny_tok):
    """1,024 choices (the cap) compile as one terminal, not 1,024 Earley alternatives, so the
    first token does not meet the parser's row limit. The matcher takes a whole choice."""
    items = [f"item{i}" for i in range(1024)]
    g = compiler.compile(P(choice=items), timeout=60)
    m = g.matcher()
    ids = tiny_tok.encode("item1023", add_special_tokens=False)
    assert m.accept_tokens(ids) == len(ids)
    assert m.is_accepting() and not m.ll_matcher.is_error()


def test_the_probe_refuses_what_overruns_the_engine_at_its_first_token(compiler, monkeypatch):
    """With the static limit lifted, a 5,000-literal alternation compiles but its first token
    overruns llguidance's Earley row (2,000 items): refused at compile time, a 400, never a
    failure mid-generation."""
    monkeypatch.setattr(limits, "MAX_ALTERNATIVES", 100_000)
    grammar = "start: " + " | ".join(f'"w{i}"' for i in range(5000))
    with pytest.raises(StructuredOutputsError, match="beyond what the grammar engine") as e:
        compiler.compile(P(grammar=grammar), timeout=60)
    assert len(str(e.value)) < 1000                     # short, not the whole grammar


def test_compile_threads_have_a_large_stack(tiny_model_dir):
    """A 20,000-rule chain (the limit lifted) overflows an 8 MiB thread stack and segfaults;
    the compile workers' 256 MiB stack takes it. In a child process, so a regression fails
    this test instead of killing the test run."""
    code = f"""
import sys
from iterserve.model.tokenizer import Tokenizer
from iterserve.structured import limits
from iterserve.structured.backend import StructuredOutputCompiler
from iterserve.structured import StructuredOutputsParams as P
limits.MAX_GRAMMAR_RULES = limits.MAX_CONSTRAINT_BYTES = 10 ** 9
tok = Tokenizer.from_hf_dir({str(tiny_model_dir)!r})
c = StructuredOutputCompiler(tok, tok.vocab_size)
n = 20000
g = "\\n".join(["start: r1"] + [f"r{{i}}: r{{i + 1}}" for i in range(1, n)] + [f'r{{n}}: "a"'])
c.compile(P(grammar=g), timeout=120)
print("compiled")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0 and "compiled" in r.stdout, (r.returncode, r.stderr[-2000:])


def test_limits_module_imports_no_torch():
    code = ("import sys; import iterserve.structured.limits; "
            "print('torch' in sys.modules or 'llguidance' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_readme_states_the_limits():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    for name in ("MAX_CHOICES", "MAX_GRAMMAR_RULES", "MAX_REPEAT_PRODUCT", "MAX_PROPERTIES"):
        value = getattr(limits, name)
        assert f"{value:,}" in readme, name
