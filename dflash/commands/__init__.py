"""The subcommands of `dflash`, one module each, in the order `dflash --help` lists them.

Each module has `add_parser(sub)` (its flags and help, torch-free) and `run(args) -> int`
(the exit code); a module may also have `what_next(args) -> str | None`, what to do after Ctrl-C (None,
or no such function: run the same command again). dflash/cli.py builds the parser from this list and
dispatches; nothing below this package imports it.
"""
from __future__ import annotations

import argparse
import importlib

NAMES = ("train", "eval", "export", "serve", "stalls", "timeline", "watch", "data", "capture")


def command(name: str):
    """The module of subcommand ``name``."""
    return importlib.import_module(f"{__name__}.{name}")


class Once(argparse.Action):
    """A path flag that takes one value and may be given once (``--config``): a second one is
    an error, not a silent replacement of the first (two config files do not merge), and an
    empty one is an error, never read as the flag left out."""

    def __call__(self, parser, namespace, values, option_string=None):
        if isinstance(values, str) and not values.strip():  # a variable that expanded to nothing: not "absent"
            parser.error(f"{option_string} {values!r}: expected a path")
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)!r}, then {values!r}); "
                         f"give it once (and --set KEY=VALUE for the rest)")
        setattr(namespace, self.dest, values)


class CommaList(argparse.Action):
    """A comma list that may also be given again (``--tracker tensorboard --tracker mlflow``):
    the lists add up, as the repeated form reads."""

    def __call__(self, parser, namespace, values, option_string=None):
        if not any(v.strip() for v in values.split(",")):  # "" or ",": a variable that expanded to nothing
            parser.error(f"{option_string} {values!r}: expected one or more names, comma-separated")
        before = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, f"{before},{values}" if before else values)
