"""`data.chat_template` (a Jinja file that replaces the tokenizer's chat template) and
`data.chat_template_kwargs` (template variables, e.g. ``enable_thinking: false``).

:func:`check` validates both without torch or transformers (config.validate calls it, so a
bad file is one line, exit 2, in milliseconds). :func:`configure` applies them to a loaded
tokenizer once, right after it loads; every later ``apply_chat_template`` call on that
tokenizer then renders with them: training samples, regeneration and eval prompts, the
mask-token probe. Nothing else needs to know, and the regeneration cache, keyed by the
rendered prompt ids, sees a changed template as changed prompts.
"""
from __future__ import annotations

import json

from ..preflight.inputs import short_repr
from . import template_budget
from .template_budget import ChatTemplateError  # noqa: F401 (where callers have always imported it from)

# apply_chat_template's own arguments, and the variable it sets itself: a template variable of
# the same name would change how our callers' calls behave (tokenize, add_generation_prompt,
# ...) or clash with them, so it is refused. `tools` and `documents` are template variables.
RESERVED = frozenset({
    "conversation", "messages", "chat_template", "add_generation_prompt", "continue_final_message", "tokenize",
    "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def _environment(name: str | None = None):
    """A Jinja environment that parses what transformers' chat templates may use: loop
    controls and the `{% generation %}` block (it marks assistant tokens; parsed, not run).
    Budgeted (template_budget.py): rendering in it has a time, step and output bound."""
    from jinja2.ext import Extension  # jinja2 comes with transformers

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return template_budget.environment(extensions=[Generation, "jinja2.ext.loopcontrols"], source_name=name)


_PROBE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def read_template(path: str) -> str:
    """The template text of ``path``; one line naming the value when it cannot be one. A
    template that loops or grows without bound rendering a user/assistant exchange is refused
    here too, before torch loads (other render failures wait for the tokenizer's own probe:
    transformers adds globals such as `raise_exception` that this environment lacks)."""
    from ..preflight.inputs import read_text_file

    where = f"data.chat_template={path!r}"
    text = read_text_file(path, where, "a Jinja chat template file", ChatTemplateError)
    if not text.strip():
        raise ChatTemplateError(f"{where}: the file is empty (expected a Jinja chat template)")
    from jinja2 import TemplateSyntaxError
    try:  # compiled, not only parsed: an unknown filter or test is caught here too
        template = _environment(where).from_string(text)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"{where}: not a valid Jinja template ({e.message} at line {e.lineno})") from None
    for messages, gen in ((_PROBE, False), (_PROBE[:1], True)):
        try:
            template.render(messages=messages, add_generation_prompt=gen, bos_token="", eos_token="")
        except ChatTemplateError:
            raise
        except Exception:  # judged when the tokenizer renders it, with transformers' globals
            pass
    return text


def check_kwargs(kwargs) -> dict:
    """Template variables: a mapping of names to plain values (what JSON holds, so the run's
    config.json records them as they were)."""
    if not isinstance(kwargs, dict):
        raise ChatTemplateError(f"data.chat_template_kwargs={short_repr(kwargs)}: expected a mapping of template "
                                f"variables, e.g. {{enable_thinking: false}}")
    for k, v in kwargs.items():
        if not isinstance(k, str) or not k.isidentifier():
            raise ChatTemplateError(f"data.chat_template_kwargs: key {k!r} is not a name (expected a template "
                                    f"variable such as enable_thinking)")
        if k in RESERVED:
            raise ChatTemplateError(f"data.chat_template_kwargs: key {k!r} is an argument of apply_chat_template, "
                                    f"not a template variable")
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError):
            raise ChatTemplateError(f"data.chat_template_kwargs.{k}={short_repr(v)}: expected a plain value (string, "
                                    f"number, true/false, null, list or mapping)") from None
    return kwargs


def check(path: str, kwargs) -> None:
    """Both settings, torch-free: what config.validate and `dflash data inspect` run first."""
    if path:
        read_template(path)
    check_kwargs(kwargs)


class _WithTemplateKwargs:
    """``tokenizer.apply_chat_template`` with the configured template variables added to every
    call (a caller's own keyword wins). A class, not a closure, so the tokenizer still pickles."""

    def __init__(self, tokenizer, kwargs: dict):
        self.tokenizer, self.kwargs = tokenizer, dict(kwargs)

    def __call__(self, *args, **kw):
        return type(self.tokenizer).apply_chat_template(self.tokenizer, *args, **{**self.kwargs, **kw})


def configure(tokenizer, path: str = "", kwargs: dict | None = None):
    """Apply `data.chat_template` / `data.chat_template_kwargs` to a loaded tokenizer (once,
    right after it loads) and render a two-turn probe, so a template that fails at run time
    (an undefined filter, a `raise_exception`) is one line now, not a traceback later.
    Every render from here on is budgeted (template_budget.install), the tokenizer's own
    template too: one that loops is one line naming it, within RENDER_SECONDS."""
    own = getattr(tokenizer, "name_or_path", "") or ""
    what = f"data.chat_template={path!r}" if path else f"the chat template of {own!r}" if own else \
        "the tokenizer's chat template"
    template_budget.install()
    if path:
        tokenizer.chat_template = read_template(path)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        template_budget.name_template(template, what)
    if kwargs:
        tokenizer.apply_chat_template = _WithTemplateKwargs(tokenizer, check_kwargs(kwargs))
    if path or kwargs or isinstance(template, str):
        try:
            tokenizer.apply_chat_template(_PROBE, tokenize=False)
            tokenizer.apply_chat_template(_PROBE[:1], tokenize=False, add_generation_prompt=True)
        except ChatTemplateError:
            raise  # the budget's own line names the template
        except Exception as e:  # jinja2's TemplateError, or what the template raises itself
            if not (path or kwargs):
                return tokenizer  # the tokenizer's own template, unchanged: as it always was, judged where used
            raise ChatTemplateError(f"{what} with data.chat_template_kwargs={short_repr(kwargs or {})}: rendering a "
                                    f"user/assistant exchange failed ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
    return tokenizer


def configure_from(tokenizer, data_cfg):
    """:func:`configure` with a `DataConfig`."""
    return configure(tokenizer, data_cfg.chat_template, data_cfg.chat_template_kwargs)
