"""The README's module map ("Where things live", between the module-map markers) is the one
map of the code; this keeps it true to the tree: every package is on it, every top-level
module of dflash/ is named, and every folder or file it names exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _map_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    begin, end = text.index("<!-- module-map:begin -->"), text.index("<!-- module-map:end -->")
    return [ln for ln in text[begin:end].splitlines() if ln.startswith("- ")]


def _named(line: str) -> list[str]:
    return re.findall(r"`([^`]+)`", line)


def _line_package(line: str) -> Path:
    """The folder a line is about: its first backticked path."""
    return ROOT / _named(line)[0].rstrip("/")


def test_every_package_is_on_the_map():
    named = set()
    for line in _map_lines():
        pkg = _line_package(line)
        for n in _named(line):
            if n.endswith("/"):
                # a sub-folder named on its parent's line ("otel/: ... `producer/`")
                named.add((ROOT / n.rstrip("/")) if (ROOT / n).is_dir() else (pkg / n.rstrip("/")))
    packages = {p.parent for top in ("dflash", "otel") for p in (ROOT / top).rglob("__init__.py")}
    assert sorted(str(p.relative_to(ROOT)) for p in packages - named) == []


def test_every_top_level_module_of_dflash_is_named():
    top = next(ln for ln in _map_lines() if _named(ln)[0] == "dflash/")
    modules = {p.name for p in (ROOT / "dflash").glob("*.py") if p.name != "__init__.py"}
    assert modules - set(_named(top)) == set()


def test_what_the_map_names_exists():
    missing = []
    for line in _map_lines():
        pkg = _line_package(line)
        for n in _named(line):
            if not (n.endswith("/") or n.endswith(".py") or n.endswith(".md")):
                continue  # a class or function name, not a path
            if not any(p.exists() for p in (ROOT / n, pkg / n)):
                missing.append(n)
    assert missing == []
