"""No import cycle inside dflash/ or otel/, read from the source (every import, also those
inside functions: a lazy import hides a cycle, it does not remove it), and otel/ never
imports dflash/."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules(pkg: str) -> dict[str, Path]:
    out = {}
    for f in (ROOT / pkg).rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` imports."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([mod] if mod else []))
            # `from pkg import sub` imports pkg.sub when that is a module, else a name of pkg
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` of a name inside a module: that module
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
    mods = _modules("dflash") | _modules("otel")
    known = set(mods)
    # a package's __init__ is imported with each of its modules; edges into a package
    # (`from . import x` resolved above) are kept, edges of the package to itself are not
    return {m: {t for t in _imports(m, p, known) if not m.startswith(t + ".")} for m, p in mods.items()}


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_otel_never_imports_dflash():
    bad = {m: sorted(t for t in ts if t.split(".")[0] == "dflash")
           for m, ts in _graph().items() if m.split(".")[0] == "otel"}
    assert not any(bad.values()), {m: t for m, t in bad.items() if t}


def test_the_checker_sees_a_cycle():
    """The check itself can fail: a two-module cycle through a lazy import is found."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        p = Path(d)
        (p / "x.py").write_text("def f():\n    from .y import g\n")
        (p / "y.py").write_text("from .x import f\n")
        known = {"pkg.x", "pkg.y"}
        assert _imports("pkg.x", p / "x.py", known) == {"pkg.y"}
        assert _imports("pkg.y", p / "y.py", known) == {"pkg.x"}
