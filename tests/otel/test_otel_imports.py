"""otel's module graph, read from source: no import cycle, the producer and exporter sides
meet only through the transport and the shared top-level modules, and nothing imports
dflash. Imports inside functions count too (a lazy import is still a dependency)."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OTEL = ROOT / "otel"
BRIDGE = "otel.transport"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str) -> set[str]:
    """The otel/dflash modules `path` imports (from-imports of a package resolve to its
    submodule when one exists)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if _exists(sub) else base)
    return {m for m in out if m.split(".")[0] in ("otel", "dflash")}


def _exists(module: str) -> bool:
    p = ROOT.joinpath(*module.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(OTEL.rglob("*.py")):
        name = _module_name(path)
        graph[name] = {m for m in _imports(path, name) if m != name}
    return graph


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _side(module: str) -> str:
    if _in(module, "otel.producer"):
        return "producer"
    if _in(module, "otel.exporter"):
        return "exporter"
    if module in ("otel", BRIDGE):
        return module
    return "shared"


def test_graph_is_read():
    g = _graph()
    assert {"otel", "otel.transport", "otel.producer.telemetry", "otel.exporter.process"} <= set(g)
    assert "otel.exporter.consumer" in g["otel.transport"]


def test_no_otel_module_imports_dflash():
    bad = {m: sorted(d for d in deps if d.split(".")[0] == "dflash") for m, deps in _graph().items()}
    assert not {m: d for m, d in bad.items() if d}


def test_no_import_cycle():
    full = _graph()
    # otel/__init__ only re-exports; every submodule's import runs it first, so it is left
    # out (the layering test keeps every other module from importing it)
    g = {m: {d for d in deps if d in full and d != "otel"} for m, deps in full.items() if m != "otel"}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(g[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_sides_meet_only_through_the_transport():
    """producer -> producer | shared | transport; exporter -> exporter | shared | transport;
    shared -> shared only; the transport -> shared, and the exporter side lazily (thread
    mode and the fallback run the consumer in the training process). No module but the
    package's own __init__ imports `otel` itself."""
    allowed = {
        "producer": {"producer", "shared", BRIDGE},
        "exporter": {"exporter", "shared", BRIDGE},
        "shared": {"shared"},
        BRIDGE: {"shared", "exporter"},
    }
    wrong = []
    for m, deps in _graph().items():
        side = _side(m)
        if side == "otel":
            continue
        for d in deps:
            if d.split(".")[0] != "otel":
                continue
            if _side(d) not in allowed[side]:
                wrong.append(f"{m} ({side}) imports {d} ({_side(d)})")
    assert not wrong, "\n".join(wrong)


def test_the_transport_loads_the_exporter_side_only_lazily():
    tree = ast.parse((OTEL / "transport.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if _in(n, "otel.exporter") or _in(n, "otel.producer")]


def test_importing_otel_loads_neither_the_sdk_nor_torch():
    code = ("import sys, otel; otel.Telemetry; otel.read_spans; otel.IdleRules; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'opentelemetry', 'torch', 'google', "
            "'grpc'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
