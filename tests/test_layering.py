"""The layers of docs/ARCHITECTURE.md ("Layers"), checked on the source itself.

Every import of every module under src/iterserve is read with `ast`, the ones inside
functions included (a function-level import is an arrow like any other, only hidden); an
`if TYPE_CHECKING:` block is left out, as it never runs (annotations only). The
top-level packages (core, model, engine, ...) and modules (errors.py, cli.py, __init__.py)
must form no circle, and every arrow must point down the layer order the document states on
its "Layer order" line; core must import no torch, statically (its modules and everything
they import, at any level) and when imported.

Run as a script (`python tests/test_layering.py [--root DIR] [--order "a < b, c < ..."]`) it
prints the whole graph's numbers: internal imports and how many sit in functions, the
circles between modules and between packages, and the arrows against the order.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER_LINE = re.compile(r"^Layer order \(ground floor first\): (.+)$", re.M)


@dataclass(frozen=True)
class Edge:
    src: str          # importing module, e.g. "iterserve.core.scheduler"
    dst: str          # imported module (the longest module prefix of the imported name)
    line: int
    in_function: bool


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the iterserve package."""
    out = {}
    for path in sorted((root / "src" / "iterserve").rglob("*.py")):
        parts = list(path.relative_to(root / "src").with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def internal_imports(root: Path = ROOT) -> list[Edge]:
    """Every import of one iterserve module by another, one Edge per imported module."""
    mods = modules(root)
    edges = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                inside = in_function or isinstance(
                    child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, ast.If) and _is_type_checking(child.test):
                    # the `if TYPE_CHECKING:` body never runs; its `else:` does
                    visit(ast.Module(body=child.orelse, type_ignores=[]), inside)
                    continue
                if isinstance(child, ast.Import):
                    names = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        anchor = package.split(".")[:len(package.split(".")) - child.level + 1]
                        base = ".".join(anchor + ([base] if base else []))
                    names = [f"{base}.{a.name}" for a in child.names]
                else:
                    visit(child, inside)
                    continue
                targets = {_resolve(n, mods) for n in names if n.split(".")[0] == "iterserve"}
                for dst in sorted(t for t in targets if t and t != mod):
                    edges.append(Edge(mod, dst, child.lineno, inside))

        visit(tree, False)
    return edges


def layer(module: str) -> str:
    """The top-level package or module a module belongs to: iterserve.core.scheduler ->
    "core", iterserve.errors -> "errors", iterserve (the package's __init__) -> "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def documented_order(text: str) -> list[set[str]]:
    """The "Layer order (ground floor first): a < b, c < ..." line as [{a}, {b, c}, ...]."""
    m = ORDER_LINE.search(text)
    if m is None:
        raise AssertionError("docs/ARCHITECTURE.md has no 'Layer order (ground floor first):' "
                             "line in its Layers section")
    levels = []
    for level in m.group(1).split(" < "):
        names = {n.strip().strip("`").rstrip("/").removesuffix(".py") for n in level.split(",")}
        levels.append(names)
    return levels


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_graph(edges: list[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in edges:
        a, b = layer(e.src), layer(e.dst)
        if a != b:
            graph.setdefault(a, set()).add(b)
    return graph


def arrows_against(edges: list[Edge], order: list[set[str]]) -> list[Edge]:
    """Imports of a layer by one below it (or by one at the same level, another package)."""
    rank = {name: i for i, level in enumerate(order) for name in level}
    return [e for e in edges if layer(e.src) != layer(e.dst)
            and rank.get(layer(e.dst), len(order)) >= rank.get(layer(e.src), len(order))]


def _where(edges: list[Edge]) -> str:
    return "\n".join(f"  {e.src}:{e.line}{' (in a function)' if e.in_function else ''} "
                     f"imports {e.dst}" for e in edges)


# --- the tests -------------------------------------------------------------------------------

def _order() -> list[set[str]]:
    return documented_order((ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8"))


def test_every_top_level_package_and_module_has_a_place_in_the_layer_order():
    placed = set().union(*_order())
    present = {layer(m) for m in modules()}
    assert present <= placed, f"not in the documented layer order: {sorted(present - placed)}"


def test_no_circle_between_the_top_level_packages():
    edges = internal_imports()
    found = cycles(layer_graph(edges))
    detail = [_where([e for e in edges if layer(e.src) in c and layer(e.dst) in c
                      and layer(e.src) != layer(e.dst)]) for c in found]
    assert not found, "import circles between layers:\n" + "\n".join(
        f"{' <-> '.join(c)}:\n{d}" for c, d in zip(found, detail))


def test_every_import_points_down_the_documented_layer_order():
    bad = arrows_against(internal_imports(), _order())
    assert not bad, "imports against the layer order of docs/ARCHITECTURE.md:\n" + _where(bad)


def _imports_torch(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [])
        if any(n == "torch" or n.startswith("torch.") for n in names):
            return True
    return False


def test_core_imports_no_torch_at_any_level():
    """Statically: no module core reaches, through imports at module or function level,
    imports torch."""
    mods, edges = modules(), internal_imports()
    out: dict[str, set[str]] = {}
    for e in edges:
        out.setdefault(e.src, set()).add(e.dst)
    reach = {m for m in mods if layer(m) == "core"}
    todo = list(reach)
    while todo:
        for dst in out.get(todo.pop(), ()):
            if dst not in reach:
                reach.add(dst)
                todo.append(dst)
    torch_users = sorted(m for m in reach if _imports_torch(mods[m]))
    assert not torch_users, f"core reaches modules that import torch: {torch_users}"


def test_importing_every_core_module_loads_no_torch():
    core = [m for m in modules() if layer(m) == "core"]
    code = ("import importlib, sys\n"
            f"for m in {core!r}:\n    importlib.import_module(m)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


# --- the script ------------------------------------------------------------------------------

def report(root: Path, order: list[set[str]]) -> str:
    edges = internal_imports(root)
    statements = {(e.src, e.line, e.dst) for e in edges}
    in_functions = {(e.src, e.line, e.dst) for e in edges if e.in_function}
    module_graph: dict[str, set[str]] = {}
    for e in edges:
        # a package's __init__ importing its own modules (or they it) is not a circle
        if not (e.dst.startswith(e.src + ".") or e.src.startswith(e.dst + ".")):
            module_graph.setdefault(e.src, set()).add(e.dst)
    module_cycles = cycles(module_graph)
    layer_cycles = cycles(layer_graph(edges))
    against = arrows_against(edges, order)
    pairs = sorted({(layer(e.src), layer(e.dst)) for e in against})
    lines = [f"internal imports: {len(statements)}, inside functions: {len(in_functions)}",
             f"circles between modules: {len(module_cycles)}",
             *(f"  {' <-> '.join(c)}" for c in module_cycles),
             f"circles between top-level packages: {len(layer_cycles)}",
             *(f"  {' <-> '.join(c)}" for c in layer_cycles),
             f"arrows against the layer order: {len(pairs)} ({len(against)} imports)"]
    for a, b in pairs:
        lines.append(f"  {a} -> {b}")
        lines += [f"    {e.src}:{e.line}{' (in a function)' if e.in_function else ''}"
                  for e in against if (layer(e.src), layer(e.dst)) == (a, b)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="a checkout (default: this one)")
    ap.add_argument("--order", help='the layer order, "a < b, c < d" (default: the one in '
                                    "the checkout's docs/ARCHITECTURE.md)")
    args = ap.parse_args(argv)
    order = (documented_order(f"Layer order (ground floor first): {args.order}")
             if args.order else
             documented_order((args.root / "docs" / "ARCHITECTURE.md").read_text("utf-8")))
    print(report(args.root, order))
    return 0


if __name__ == "__main__":
    sys.exit(main())
