"""The product speaks of the product, not of its making.

Code, docs, benchmark scripts and result names say why things are as they are; when they
became so lives in git. This test fails on the words of a project's history: work sessions
("session 15", "s15"-style variant names), the people or agents who built it ("engineers",
"helpers"), tracker references ("issue 13"), and "earlier version" wording. It reads the
files from disk (no git needed), so it runs the same in CI and in a checkout.

Scope: src/ (every text file), docs/*.md, README.md, BENCHMARKS.md, benchmarks/*.py and
benchmarks/peers/*.py, and the names of everything under benchmarks/results/.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PATTERNS = [re.compile(p, re.IGNORECASE) for p in (
    r"\bsessions?[ -]?\d+",                              # session 15, session-13
    r"\b(?:this|that|last|next|previous|earlier) session\b",
    r"\bs1\d\b",                                         # s14 / s15 / s16 variant names
    r"\bengineers?\b",
    r"\bhelpers?\b",                                     # say "function" for code
    r"\bintegrator\b",
    r"\bissues? #?\d+",
    r"\b(?:earlier|previous|older) versions?\b",
    r"\bold main\b",
    r"\bBRIEF\.md\b",
)]

# What must stay, each with why: (path relative to the repository, exact text on the line).
ALLOWED: set[tuple[str, str]] = set()

EXCLUDED_DIRS: tuple[str, ...] = ()

TEXT_SUFFIXES = {".py", ".md", ".js", ".html", ".css", ".json", ".toml", ".txt", ".c", ".h",
                 ".cfg", ".ini", ".yaml", ".yml", ".jinja", ".sh"}


def _excluded(rel: str) -> bool:
    return any(rel == d or rel.startswith(d + "/") for d in EXCLUDED_DIRS)


def scanned_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
    files += sorted((ROOT / "docs").glob("*.md"))
    files += sorted((ROOT / "benchmarks").glob("*.py"))
    files += sorted((ROOT / "benchmarks" / "peers").glob("*.py"))
    for p in sorted((ROOT / "src").rglob("*")):
        rel = p.relative_to(ROOT).as_posix()
        if (p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts
                and not _excluded(rel)):
            files.append(p)
    return [p for p in files if p.is_file()]


# In C, s12 / s16 are ordinary identifiers (12 scale bytes, 16-bit lanes): there the variant
# pattern only counts a quoted or assigned name ("s15", =s15) or one naming a kernel or path.
C_VARIANT = re.compile(r'["=]s1\d\b|\bs1\d(?:\'s)? (?:kernels?|paths?|variants?)\b', re.IGNORECASE)
C_PATTERNS = [C_VARIANT] + [p for p in PATTERNS if p.pattern != r"\bs1\d\b"]


def offending_lines(rel: str, text: str) -> list[str]:
    out = []
    patterns = C_PATTERNS if rel.endswith((".c", ".h")) else PATTERNS
    for no, line in enumerate(text.splitlines(), 1):
        if any(pat.search(line) for pat in patterns):
            if not any(rel == path and snippet in line for path, snippet in ALLOWED):
                out.append(f"{rel}:{no}: {line.strip()[:120]}")
    return out


def test_the_patterns_catch_history_and_spare_the_product():
    history = ["measured quietly at the end of session 15", "`ITERSERVE_KQ_DECODE=s15`",
               "seven engineers shared the machine", "other helpers' jobs", "(issue 13)",
               "as the integrator runs it", "an earlier version of this kernel",
               "the old main 64b1993", "the bench range (BRIEF.md)", "this session's run"]
    product = ["sessionStorage.getItem(KEY)", "start_new_session=True",
               "the previous step's tokens", "an earlier arrival goes first",
               "the validation functions", "s8 slots", "--sat-slots 8,16,32"]
    assert all(offending_lines("x", s) for s in history)
    assert not any(offending_lines("x", s) for s in product)
    assert offending_lines("k.c", "/* as ITERSERVE_KQ_DECODE=s15 did */")
    assert offending_lines("k.c", "/* the s15 kernel */")
    assert not offending_lines("k.c", "q4k_scales(s12, u); const __m256i s16 = x;")


def test_the_scope_is_what_the_product_ships():
    rels = {p.relative_to(ROOT).as_posix() for p in scanned_files()}
    for must in ("README.md", "BENCHMARKS.md", "docs/ARCHITECTURE.md",
                 "benchmarks/run_models.py", "src/iterserve/core/scheduler.py"):
        assert must in rels
    assert not any(_excluded(r) for r in rels)


def test_code_docs_and_benchmarks_speak_of_the_product():
    bad = []
    for p in scanned_files():
        rel = p.relative_to(ROOT).as_posix()
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        bad += offending_lines(rel, text)
    assert not bad, "history words in the product:\n" + "\n".join(bad)


def test_result_names_say_what_they_measure():
    results = ROOT / "benchmarks" / "results"
    if not results.is_dir():
        pytest.skip("no benchmarks/results in this checkout")
    session = re.compile(r"session", re.IGNORECASE)
    bad = [p.relative_to(results).as_posix() for p in sorted(results.rglob("*"))
           if session.search(p.name) or any(pat.search(p.name) for pat in PATTERNS)]
    assert not bad, "result names after sessions or variants:\n" + "\n".join(bad)
