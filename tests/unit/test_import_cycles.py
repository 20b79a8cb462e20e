"""No import cycle inside dflash/ or otel/, read from the source (every import, also those
inside functions: a lazy import hides a cycle, it does not remove it). Between the packages of
dflash/, test_layering.py's floors already rule cycles out; this finds those inside a package.
AST only: fast, no torch."""
from __future__ import annotations

from pathlib import Path

from import_graph import imports, modules


def _edges(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` imports (an import of a name inside a
    module, `import a.b.c`, is one of that module)."""
    found = set()
    for i in imports(path, name, is_module=known.__contains__):
        t = i.module
        while t and t not in known:
            t = t.rpartition(".")[0]
        if t and t != name:
            found.add(t)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _graph() -> dict[str, set[str]]:
    mods = modules("dflash", "otel")
    known = set(mods)
    # a package's __init__ is imported with each of its modules; edges into a package
    # (`from . import x` resolved above) are kept, edges of the package to itself are not
    return {m: {t for t in _edges(m, p, known) if not m.startswith(t + ".")} for m, p in mods.items()}


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_a_cycle():
    """The check itself can fail: a two-module cycle through a lazy import is found."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        p = Path(d)
        (p / "x.py").write_text("def f():\n    from .y import g\n")
        (p / "y.py").write_text("from .x import f\n")
        known = {"pkg.x", "pkg.y"}
        assert _edges("pkg.x", p / "x.py", known) == {"pkg.y"}
        assert _edges("pkg.y", p / "y.py", known) == {"pkg.x"}
