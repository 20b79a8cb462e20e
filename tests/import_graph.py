"""The one AST import reader of the structure tests (test_layering.py, test_import_cycles.py,
tests/otel/test_otel_imports.py): every import of a file, module-level and inside functions
(a lazy import is still a dependency), resolved to the module it loads, with its line.
AST only: fast, no torch."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Import:
    path: Path      # the importing file
    line: int
    module: str     # the module it loads: `from pkg import sub` is pkg.sub where that is a module

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(*packages: str) -> dict[str, Path]:
    """Every module of the given top-level packages (folders under the repository root)."""
    return {module_name(f): f for pkg in packages for f in sorted((ROOT / pkg).rglob("*.py"))}


def is_module(name: str) -> bool:
    p = ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def imports(path: Path, name: str | None = None, is_module=is_module) -> list[Import]:
    """Every import in `path` (module `name`, from its place under ROOT by default), in order.
    A relative import is made absolute; `from a import b` loads a.b when that is a module
    (by `is_module`), else a; `import a.b.c` loads a.b.c."""
    name = name if name is not None else module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [Import(path, node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[:len(package) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append(Import(path, node.lineno, sub if is_module(sub) else base))
    return sorted(out, key=lambda i: i.line)


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")
