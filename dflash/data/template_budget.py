"""A time, step and output budget for rendering chat templates.

A chat template is code from elsewhere (a tokenizer from the hub, a features dir, a
`data.chat_template` file). Jinja's sandbox stops it from touching the machine, but not from
looping: `range(100000)` nested twice is 10^10 iterations, and `'x' * 10**10` or a literal
repeated in a loop allocates until memory runs out. So every template dflash renders is
compiled in :class:`BudgetedEnvironment`, a sandbox that

- counts steps: every block body (each loop iteration, branch, macro and block), every call
  and every filter; a loop however empty steps once an iteration;
- checks the clock every few steps against RENDER_SECONDS, and the steps against
  RENDER_MAX_STEPS;
- caps what a render can produce at RENDER_MAX_CHARS: output pieces are counted as they are
  joined; `*` `+` on strings and lists, `**`, `%` and `format` with huge field widths, and
  large integer arguments of string methods and filters (`center(10**10)`) are checked
  *before* they allocate, `~` results after;
- compiles nothing into a constant at compile time that the checks would not see (intercepted
  operators are never folded).

Going over any of them is one line naming the template (ChatTemplateError, exit 2).

transformers renders `apply_chat_template` with its own environment; :func:`install` makes
its compile step (`chat_template_utils._compile_jinja_template`) build the template in a
BudgetedEnvironment that carries the same filters, globals and extensions instead, so every
render, whoever calls it, has the budget. A transformers without that function keeps its own
rendering (and the probe render at configure time still catches a looping template there).
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import time

from otel.env_values import number_from_env

from ..preflight.inputs import MAX_RECORD_BYTES, DatasetError


def _seconds(name: str, default: float) -> float:
    return number_from_env(name, default, hi=86400.0, unit="seconds", who="dflash")


RENDER_SECONDS = _seconds("DFLASH_RENDER_SECONDS", 10.0)  # one render; real templates take milliseconds
RENDER_MAX_STEPS = 10_000_000       # block bodies, calls, operations; a long conversation takes thousands
RENDER_MAX_CHARS = 2 * MAX_RECORD_BYTES  # output of one render: a whole record fits, twice
_SEQ = (str, list, tuple)
_CLOCK_EVERY = 64                   # steps between clock readings (~50 ns each)
_MAX_ARG = 1_000_000                # an integer argument of a filter or a string method (a width, a count)
# format strings that would allocate a field of a million characters or more, or take the width
# from an argument: printf style (`%9999999d`, `%*d`) and str.format style (`{:9999999}`, `{:{}}`)
_WIDE_FORMAT = re.compile(r"%[-#0 +]*(?:\*|\d{7,}|\d*\.(?:\*|\d{7,}))|\{[^{}]*:[^{}]*(?:\d{7,}|\{)")


class ChatTemplateError(DatasetError):
    """A chat template file or template variables that cannot be used (bad input, exit 2)."""


_names: dict[str, str] = {}  # template source -> how the user knows it (set by chat_template.configure)


def name_template(source: str, name: str) -> None:
    """How messages name the template with this source (a path, "the tokenizer's chat template")."""
    if source:
        _names[source] = name


class _Budget(threading.local):
    active = False
    deadline = 0.0
    steps = 0
    chars = 0


@functools.cache
def _environment_class():
    from jinja2.compiler import CodeGenerator
    from jinja2.environment import Template
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BudgetedCodeGenerator(CodeGenerator):
        def blockvisit(self, nodes, frame):
            self.writeline("environment.step()")  # each loop iteration, branch, macro and block body
            super().blockvisit(nodes, frame)

        def visit_Concat(self, node, frame):
            self.write("environment.checked_concat(")
            super().visit_Concat(node, frame)
            self.write(")")

    class BudgetedTemplate(Template):
        def render(self, *args, **kwargs):
            with self.environment.budget():
                try:
                    return super().render(*args, **kwargs)
                except RecursionError:
                    self.environment.fail("recursion too deep")

        def generate(self, *args, **kwargs):
            with self.environment.budget():
                try:
                    for piece in super().generate(*args, **kwargs):
                        self.environment.count_output(piece)
                        yield piece
                except RecursionError:
                    self.environment.fail("recursion too deep")

    class BudgetedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = BudgetedCodeGenerator
        template_class = BudgetedTemplate
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def __init__(self, *args, source_name: str | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.state = _Budget()
            self.source_name = source_name
            self.filters = {k: self._checked_filter(f) for k, f in self.filters.items()}

        # -- the budget of one render -----------------------------------------------
        @contextlib.contextmanager
        def budget(self):
            st = self.state
            outer = st.active  # a render inside a render shares the outer one's budget
            if not outer:
                st.active, st.deadline, st.steps, st.chars = True, time.monotonic() + RENDER_SECONDS, 0, 0
            try:
                yield
            finally:
                if not outer:
                    st.active = False

        def fail(self, why: str):
            name = self.source_name or "a chat template"
            raise ChatTemplateError(
                f"{name}: rendering stopped, {why} (a render may take {RENDER_SECONDS:g} s, {RENDER_MAX_STEPS:,} steps "
                f"and {RENDER_MAX_CHARS >> 20}M characters)")

        def step(self) -> None:
            st = self.state
            if not st.active:
                return
            st.steps += 1
            if st.steps > RENDER_MAX_STEPS:
                self.fail(f"more than {RENDER_MAX_STEPS} steps")
            if st.steps % _CLOCK_EVERY == 0 and time.monotonic() > st.deadline:
                self.fail(f"over {RENDER_SECONDS:g} s")

        def count_output(self, piece) -> None:
            st = self.state
            if st.active:
                st.chars += len(piece) if isinstance(piece, str) else 1
                if st.chars > RENDER_MAX_CHARS:
                    self.fail(f"output over {RENDER_MAX_CHARS} characters")
                self.step()

        def concat(self, pieces):
            """What render() joins the output with, and every macro its own: each join is
            capped (the render's is its whole output). The template's code runs in between
            (``pieces`` is its generator), and its loops step themselves."""
            out, n = [], 0
            for piece in pieces:
                out.append(piece)
                n += len(piece)
                if n > RENDER_MAX_CHARS:
                    self.fail(f"output over {RENDER_MAX_CHARS} characters")
            return "".join(out)

        def checked_concat(self, s):
            if len(s) > RENDER_MAX_CHARS:
                self.fail(f"a string of {len(s)} characters")
            return s

        # -- operations that allocate: checked before they run ------------------------
        def _check_size(self, n: int, what: str) -> None:
            if n > RENDER_MAX_CHARS:
                self.fail(f"{what} of {n} items")

        def _check_args(self, args, kwargs) -> None:
            for a in (*args, *kwargs.values()):
                if isinstance(a, int) and not isinstance(a, bool) and abs(a) > _MAX_ARG:
                    self.fail(f"an argument of {a} (at most {_MAX_ARG})")

        def _check_format(self, f) -> None:
            if isinstance(f, str) and _WIDE_FORMAT.search(f):
                self.fail("a format with a field width of a million or more, or taken from an argument")

        def call_binop(self, context, operator, left, right):
            # on the path of every `+` in a template: plain code, the operator applied directly
            if operator == "+":
                if isinstance(left, _SEQ) and isinstance(right, _SEQ) and len(left) + len(right) > RENDER_MAX_CHARS:
                    self.fail(f"a concatenation of {len(left) + len(right)} items")
                return left + right
            if operator == "*":
                for a, b in ((left, right), (right, left)):
                    if isinstance(a, _SEQ) and isinstance(b, int):
                        self._check_size(len(a) * max(b, 0), "a repetition")
            elif operator == "**" and isinstance(left, (int, float)) and isinstance(right, int) \
                    and abs(right) > 4096 and abs(left) > 1:
                self.fail(f"a power with exponent {right}")
            elif operator == "%":
                self._check_format(left)
            return self.binop_table[operator](left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            __self.step()
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, (str, list, tuple)):  # 'x'.ljust(10**10), '{:9999999999}'.format(1)
                __self._check_args(args, kwargs)
                if getattr(__obj, "__name__", "") in ("format", "format_map"):
                    __self._check_format(owner)
            return super().call(__context, __obj, *args, **kwargs)

        def _checked_filter(self, f):
            if getattr(f, "_budgeted", False):
                return f
            env = self

            skip = 2 if hasattr(f, "jinja_pass_arg") else 1  # the context/environment, then the value

            @functools.wraps(f)  # keeps jinja_pass_arg
            def checked(*args, **kwargs):
                env.step()
                env._check_args(args[skip:], kwargs)
                if getattr(f, "__name__", "") == "do_format" and len(args) >= skip:
                    env._check_format(args[skip - 1])  # `"%9999999d"|format(1)`: the value is the format
                return f(*args, **kwargs)

            checked._budgeted = True
            return checked

        def adopt(self, other) -> None:
            """Take another environment's filters, tests and globals (transformers': `tojson`,
            `raise_exception`, `strftime_now`, its `namespace`), each filter budgeted too."""
            for k, f in other.filters.items():
                self.filters[k] = self._checked_filter(f)
            self.tests.update(other.tests)
            self.globals.update(other.globals)
            self.policies.update(other.policies)

    return BudgetedEnvironment


def environment(*, extensions=(), source_name: str | None = None, **kwargs):
    """A new BudgetedEnvironment (trim_blocks and lstrip_blocks, as transformers renders)."""
    kwargs.setdefault("trim_blocks", True)
    kwargs.setdefault("lstrip_blocks", True)
    return _environment_class()(extensions=list(extensions), source_name=source_name, **kwargs)


# ----------------------------------------------------------------------------- transformers
_installed: dict = {}


def install() -> bool:
    """Make transformers compile chat templates in a BudgetedEnvironment (idempotent; False
    when this transformers has no such compile step to replace)."""
    if _installed:
        return True
    try:
        from transformers.utils import chat_template_utils as ctu
    except ImportError:
        return False
    original = getattr(ctu, "_compile_jinja_template", None)
    if original is None or getattr(original, "_dflash_budgeted", False):
        return original is not None

    @functools.lru_cache(maxsize=64)
    def compile_budgeted(chat_template):
        theirs = original(chat_template).environment  # their filters, globals and extensions, as they set them up
        env = environment(extensions=[type(e) for e in theirs.extensions.values()],
                          trim_blocks=theirs.trim_blocks, lstrip_blocks=theirs.lstrip_blocks,
                          source_name=_names.get(chat_template, "the tokenizer's chat template"))
        env.adopt(theirs)
        return env.from_string(chat_template)

    compile_budgeted._dflash_budgeted = True
    _installed["original"] = original
    ctu._compile_jinja_template = compile_budgeted
    return True
