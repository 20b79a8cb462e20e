"""The subcommands of `dflash`, one module each, in the order `dflash --help` lists them.

Each module has `add_parser(sub)` (its flags and help, torch-free) and `run(args) -> int`
(the exit code); a module may also have `what_next(args) -> str | None`, what to do after Ctrl-C (None,
or no such function: run the same command again). dflash/cli.py builds the parser from this list and
dispatches; nothing below this package imports it.
"""
from __future__ import annotations

import importlib

NAMES = ("train", "eval", "export", "serve", "stalls", "timeline", "watch", "data", "capture")


def command(name: str):
    """The module of subcommand ``name``."""
    return importlib.import_module(f"{__name__}.{name}")
