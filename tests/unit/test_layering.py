"""Nothing imports upward, read from the source (every import, also those inside functions):

- config.py and model/ import nothing from run/ or commands/; model/ (the networks, the
  target and its features) nothing from decode/ or checkpoint/ either, which build on it;
- no module below commands/ imports commands/ (only cli.py and commands/ itself do);
- otel/ never imports dflash/ (it is a layer others could use).
AST only: fast, no torch."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    """Absolute names of every module (or module.name) that the file imports."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    base = parts if parts[-1] == "__init__" else parts[:-1]
    base = [p for p in base if p != "__init__"]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([mod] if mod else []))
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def _offenders(files, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{f.relative_to(ROOT)}: {name}" for f in files for name in _imports(f)
                  if any(name == p or name.startswith(p + ".") for p in forbidden))


def _py(*paths: str) -> list[Path]:
    out = []
    for p in paths:
        q = ROOT / p
        out += [q] if q.suffix == ".py" else sorted(q.rglob("*.py"))
    return out


def test_config_imports_nothing_from_run_or_commands():
    assert _offenders(_py("dflash/config.py"), ("dflash.run", "dflash.commands", "dflash.cli")) == []


def test_model_imports_nothing_from_the_layers_above_it():
    above = ("dflash.run", "dflash.commands", "dflash.cli", "dflash.decode", "dflash.checkpoint")
    assert _offenders(_py("dflash/model"), above) == []


def test_nothing_below_commands_imports_commands():
    below = [f for f in _py("dflash") if f.relative_to(ROOT).parts[1] not in ("commands", "cli.py", "__main__.py")]
    assert _offenders(below, ("dflash.commands", "dflash.cli")) == []


def test_otel_never_imports_dflash():
    assert _offenders(_py("otel"), ("dflash",)) == []


def test_the_check_sees_relative_imports():
    """A guard for the guard: the relative import cli.py makes of commands/ is found."""
    assert "dflash.commands.command" in _imports(ROOT / "dflash" / "cli.py")


_STARTERS = {"Popen", "run", "call", "check_call", "check_output", "system", "popen", "spawnv", "spawnve",
             "execv", "execve", "execvp", "Process", "Pool"}


def _process_starts(path: Path) -> list[str]:
    """Calls in the file that start a process (subprocess.*, os.system/exec*/spawn*, multiprocessing)."""
    tree = ast.parse(path.read_text(), str(path))
    mods = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
            if a.name in ("subprocess", "os", "multiprocessing")}
    out = []
    for node in ast.walk(tree):
        f = node.func if isinstance(node, ast.Call) else None
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in mods and \
                f.attr in _STARTERS:
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {f.value.id}.{f.attr}")
    return out


def test_every_child_process_starts_through_otel_confined():
    """Nothing from elsewhere runs (docs/failures.md): a Python child started any other way
    could import a package planted in its cwd or a run dir. One place starts them."""
    files = [f for f in _py("dflash", "otel") if f != ROOT / "otel" / "confined.py"]
    assert [s for f in files for s in _process_starts(f)] == []
    assert _process_starts(ROOT / "otel" / "confined.py")  # the guard sees a start where there is one
