"""The command line as the docs show it is the command line argparse builds.

README's "Command line" block and docs/commands.md's "Synopsis" block are read as
synopses: `[...]` is optional, anything else required; a word after a flag is its value,
a word after the command is a positional. Each is checked against the parser dflash/cli.py
builds from dflash/commands/ (in-process: building it imports no torch):

- every flag either block shows exists, on that command;
- a flag or positional shown outside `[...]` is required (`required=True`, or a positional
  without `nargs="?"`), and one shown inside is not;
- docs/commands.md's synopsis shows every flag and positional of every command, and its
  "Flags" section has a row for every flag under the command's own heading;
- every key of the config tree (dflash/config.py's dataclasses) is named in docs/commands.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMANDS_MD = ROOT / "docs" / "commands.md"


# ------------------------------------------------------------------------------ the parser
def _commands() -> dict[str, argparse.ArgumentParser]:
    """'train' -> its parser, ..., 'data inspect' -> the sub-subcommand's parser."""
    from dflash.cli import _parser

    def walk(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    key = f"{prefix} {name}".strip()
                    if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                        yield from walk(sub, key)
                    else:
                        yield key, sub

    return dict(walk(_parser(), ""))


def _flags(parser) -> dict[str, bool]:
    """Each option string -> required."""
    return {s: a.required for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
            for s in a.option_strings if s.startswith("--")}


def _positionals(parser) -> list[bool]:
    """Each positional, in order -> required."""
    return [a.nargs not in ("?", "*") for a in parser._actions
            if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]


# ------------------------------------------------------------------------------ the docs
@dataclasses.dataclass
class Synopsis:
    command: str
    flags: dict[str, bool]        # flag -> shown required (outside every [...])
    positionals: list[bool]       # each positional, in order -> shown required
    line: str


def _block(text: str, heading: str) -> list[str]:
    """The lines of the first fenced block after ``heading``."""
    rest = text[text.index(heading):]
    start = rest.index("```")
    start = rest.index("\n", start) + 1
    return rest[start:rest.index("```", start)].splitlines()


def _synopses(lines: list[str], commands) -> list[Synopsis]:
    """One per `dflash CMD ...` line with its indented continuation lines; comments dropped."""
    entries: list[str] = []
    for line in lines:
        line = re.sub(r"\s#\s.*$", "", line).rstrip()
        if line.startswith("dflash "):
            entries.append(line)
        elif line.startswith(" ") and entries and line.strip():
            entries[-1] += " " + line.strip()
        else:
            entries.append("")   # anything else (torchrun ...) ends an entry
    out = []
    for entry in filter(None, entries):
        words = entry.split()[1:]
        name = next(n for n in sorted(commands, key=len, reverse=True) if words[:len(n.split())] == n.split())
        flags, positionals, depth, after_flag = {}, [], 0, False
        for w in words[len(name.split()):]:
            at = depth + len(w) - len(w.lstrip("["))        # the word's own depth
            depth += w.count("[") - w.count("]")
            core = w.strip("[]")
            if core in ("|", "...") or not core:
                after_flag = False if core == "|" else after_flag
                continue
            if core.startswith("--"):
                flags.setdefault(core, at == 0)
                flags[core] = flags[core] or at == 0
                after_flag = True
            elif after_flag:
                after_flag = False                        # the flag's value
            else:
                positionals.append(at == 0)
        assert depth == 0, f"unbalanced [...] in: {entry}"
        out.append(Synopsis(name, flags, positionals, entry))
    return out


def _readme_synopses(commands):
    return _synopses(_block((ROOT / "README.md").read_text(), "## Command line"), commands)


def _commands_md_synopses(commands):
    return _synopses(_block(COMMANDS_MD.read_text(), "## Synopsis"), commands)


@pytest.fixture(scope="module")
def commands():
    return _commands()


# ------------------------------------------------------------------------------ the checks
@pytest.mark.parametrize("where", ["README.md", "docs/commands.md"])
def test_every_flag_shown_exists_and_is_required_as_shown(commands, where):
    read = _readme_synopses if where == "README.md" else _commands_md_synopses
    wrong = []
    for s in read(commands):
        real = _flags(commands[s.command])
        for flag, shown_required in s.flags.items():
            if flag not in real:
                wrong.append(f"dflash {s.command}: {flag} is no flag of it")
            elif shown_required != real[flag]:
                wrong.append(f"dflash {s.command}: {flag} shown {'required' if shown_required else 'optional'}, "
                             f"is {'required' if real[flag] else 'optional'}")
        if s.positionals != _positionals(commands[s.command])[:len(s.positionals)]:
            wrong.append(f"dflash {s.command}: positionals shown {s.positionals} (True: required), "
                         f"parser {_positionals(commands[s.command])}")
    assert wrong == []


def test_commands_md_shows_every_command_flag_and_positional(commands):
    shown = {}
    for s in _commands_md_synopses(commands):
        shown.setdefault(s.command, Synopsis(s.command, {}, s.positionals, s.line)).flags.update(s.flags)
    assert sorted(shown) == sorted(commands)
    missing = [f"dflash {c}: {f}" for c, p in commands.items() for f in _flags(p) if f not in shown[c].flags]
    assert missing == []
    assert {c: s.positionals for c, s in shown.items()} == {c: _positionals(p) for c, p in commands.items()}


def test_readme_shows_every_command(commands):
    assert sorted({s.command for s in _readme_synopses(commands)}) == sorted(commands)


def _flag_rows(text: str) -> dict[str, set[str]]:
    """docs/commands.md's "Flags" section: command (from each `### dflash CMD` heading) -> the
    flags its table rows start with."""
    section = text[text.index("\n## Flags"):]
    section = section[:section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    rows: dict[str, set[str]] = {}
    command = None
    for line in section.splitlines():
        m = re.match(r"### `dflash ([a-z ]+)`", line)
        if m:
            command = m.group(1).strip()
            rows[command] = set()
        elif command and line.startswith("| `--"):
            rows[command] |= set(re.findall(r"`(--[a-z0-9-]+)", line.split("|")[1]))
    return rows


def test_every_flag_has_a_row_under_its_command(commands):
    rows = _flag_rows(COMMANDS_MD.read_text())
    assert sorted(rows) == sorted(commands)
    missing = [f"dflash {c}: {f}" for c, p in commands.items() for f in _flags(p) if f not in rows[c]]
    extra = [f"dflash {c}: {f}" for c, fs in rows.items() for f in fs if f not in _flags(commands[c])]
    assert missing == [] and extra == []


def test_every_config_key_is_named_in_commands_md():
    from dflash.config import Config

    def keys(cls, prefix=""):
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
                yield from keys(f.default_factory, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}"

    text = COMMANDS_MD.read_text()
    assert [k for k in keys(Config) if f"`{k}`" not in text] == []


def test_the_synopsis_reader_reads_brackets_values_and_positionals():
    cmds = {"x": None, "data inspect": None}
    s, = _synopses(["dflash x POS --a A [--b B [--c C[,C]] [--d]] [--e | --f] [--g G ...]",
                    "         [OPT]   # a comment [--nope]"], cmds)
    assert s.command == "x" and s.positionals == [True, False]
    assert s.flags == {"--a": True, "--b": False, "--c": False, "--d": False, "--e": False, "--f": False,
                       "--g": False}
    s, = _synopses(["dflash data inspect PATH [--json]"], cmds)
    assert s.command == "data inspect" and s.positionals == [True] and s.flags == {"--json": False}
