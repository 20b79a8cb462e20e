"""Every import runs downward: dflash/ stands on one ordered list of floors (FLOORS), and
each import (module-level and inside functions: a lazy import is still a dependency) goes
inside its own package, to a lower floor, or out of dflash/ (otel/, the standard library,
third parties). No exceptions list. Bottom to top, and why each floor sits where it does:

  dflash       the package's __init__ (a docstring): every import of dflash runs it first.
  errors       UserError, ConfigError, the failure report, signals: everything above raises them.
  phases       the run's own trace (a phase per long step of any command): every floor above marks
               its steps there, from the input checks on.
  family       the drafter families' torch-free halves (config fields, bounds, served format), which
               the checks before torch (preflight), config and every floor above read.
  preflight    the checks before torch loads, and what dflash writes (checkpoint_files.py):
               only errors beneath, so every command can check its input first.
  data         conversations, tokenization, batches, prompt sets: files in, tokens out; no
               Config (its callers pass the values) and no model (its callers pass a tokenizer).
  config       the Config tree and its checks; names data's chat templates, where the loss
               needs the target's distribution, which GPU is this rank's.
  model        the networks, the target and its features, the loss vocabulary: built from a Config.
  engine       vLLM as a child process: the targets it reads (a tiny one built by model), runs,
               verdicts.
  prep         regeneration (by HF or the engine) and the cached train/eval split.
  checkpoint, decode, offline
               what is built on a prepared model: checkpoints and exports (an export re-splits
               its run's held-out prompts through prep), speculative decoding and eval, capture
               once train many. One floor: none of the three imports another.
  analysis     stalls, timelines, the run's report (which words decode's eval figures).
  trackers     experiment trackers; their report names analysis's idle rules.
  run          the Trainer: puts every floor below together for a training run.
  commands     one module per subcommand, each doing its command's work with the floors below;
               they may import each other (train's data check serves capture too).
  cli          the parser and the dispatch over commands.
  __main__     `python -m dflash`: cli.

Packages on one floor never import each other. otel/ is a layer of its own: it never imports
dflash/ (tests/otel/test_otel_imports.py). No cycle inside a package: test_import_cycles.py.
One more fact of the source is kept here: every child process starts through otel/confined.py.
AST only (tests/import_graph.py): fast, no torch."""
from __future__ import annotations

import ast
from pathlib import Path

from import_graph import ROOT, Import, imports, modules

FLOORS = [("dflash",), ("errors",), ("phases",), ("family",), ("preflight",), ("data",), ("config",), ("model",), ("engine",), ("prep",),
          ("checkpoint", "decode", "offline"), ("analysis",), ("trackers",), ("run",), ("commands",), ("cli",),
          ("__main__",)]


def part(module: str) -> str:
    """The package or top-level module of dflash a module belongs to ("dflash": the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def floor(module: str) -> int:
    name = part(module)
    return next(i for i, f in enumerate(FLOORS) if name in f)


def upward(found: list[Import], name_of) -> list[str]:
    """`file:line: a -> b` for each import in `found` of a dflash module on the importer's floor
    or above, outside the importer's own package."""
    out = []
    for i in found:
        src, dst = name_of(i.path), i.module
        if dst.split(".")[0] != "dflash" or part(src) == part(dst):
            continue
        if floor(dst) >= floor(src):
            out.append(f"{i.where()}: {part(src)} -> {part(dst)} ({dst})")
    return out


def test_every_part_of_dflash_is_on_a_floor():
    on_floors = {p for f in FLOORS for p in f}
    parts = {part(m) for m in modules("dflash")}
    assert parts - on_floors == set(), "put these on a floor (FLOORS, and the docstring's list)"
    assert on_floors - parts == set(), "on a floor but not in dflash/"


def test_every_import_runs_downward():
    mods = modules("dflash")
    names = {p: m for m, p in mods.items()}
    found = [i for m, p in mods.items() for i in imports(p, m)]
    bad = upward(found, names.get)
    assert not bad, "imports on the same floor or upward (see FLOORS):\n" + "\n".join(bad)


def test_the_check_sees_an_upward_import_inside_a_function(tmp_path):
    """A guard for the guard: a relative import inside a function, of a package above, is found
    with its file and line; one of a package below is not."""
    pkg = tmp_path / "dflash" / "data"
    pkg.mkdir(parents=True)
    f = pkg / "x.py"
    f.write_text("from ..errors import UserError\n\ndef f():\n    from ..run.trainer import Trainer\n")
    found = imports(f, "dflash.data.x", is_module=lambda m: m in ("dflash.errors", "dflash.run.trainer"))
    assert [i.module for i in found] == ["dflash.errors", "dflash.run.trainer"]
    bad = upward([Import(ROOT / "dflash/data/x.py", i.line, i.module) for i in found], lambda p: "dflash.data.x")
    assert bad == ["dflash/data/x.py:4: data -> run (dflash.run.trainer)"]



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
    files = [f for pkg in ("dflash", "otel") for f in modules(pkg).values() if f != ROOT / "otel" / "confined.py"]
    assert [s for f in files for s in _process_starts(f)] == []
    assert _process_starts(ROOT / "otel" / "confined.py")  # the guard sees a start where there is one
