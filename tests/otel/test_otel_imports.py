"""otel's module graph, read from source (tests/import_graph.py): the producer and exporter
sides meet only through the transport and the shared top-level modules, and nothing imports
dflash (otel is a layer others could use). Imports inside functions count too (a lazy import
is still a dependency). No cycle: tests/unit/test_import_cycles.py, for otel/ and dflash/."""
import ast
import subprocess
import sys

from import_graph import ROOT, imports, modules, within

OTEL = ROOT / "otel"
BRIDGE = "otel.transport"


def _graph() -> dict[str, set[str]]:
    """otel's modules -> the otel and dflash modules each imports."""
    return {name: {i.module for i in imports(path, name) if i.module.split(".")[0] in ("otel", "dflash")} - {name}
            for name, path in modules("otel").items()}


def _side(module: str) -> str:
    if within(module, "otel.producer"):
        return "producer"
    if within(module, "otel.exporter"):
        return "exporter"
    if module in ("otel", BRIDGE):
        return module
    return "shared"


def test_graph_is_read():
    g = _graph()
    assert {"otel", "otel.transport", "otel.producer.telemetry", "otel.exporter.process"} <= set(g)
    assert "otel.exporter.consumer" in g["otel.transport"]


def test_no_otel_module_imports_dflash():
    bad = [f"{i.where()}: {i.module}" for name, path in modules("otel").items() for i in imports(path, name)
           if within(i.module, "dflash")]
    assert bad == []


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
    assert not [n for n in names if within(n, "otel.exporter") or within(n, "otel.producer")]


def test_importing_otel_loads_neither_the_sdk_nor_torch():
    code = ("import sys, otel; otel.Telemetry; otel.read_spans; otel.IdleRules; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'opentelemetry', 'torch', 'google', "
            "'grpc'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
