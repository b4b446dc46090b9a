"""--chat-template: a path to a Jinja file, or the template text itself (vLLM's rule), read once at startup; and
the time limit every chat template renders under."""

from __future__ import annotations

import codecs
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)

_JINJA_CHARS = "{}\n"


def load_chat_template(value: str | Path | None) -> str | None:
    """The template text for `value`: a file's contents when it names a readable file, else `value` itself with
    backslash escapes (\\n) decoded so a one-line template can be passed on the command line.  A value that looks
    like a path (no Jinja characters) but cannot be read is a ValueError, as is a template that does not parse."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
        logger.info("chat template read from %s", path)
    except (OSError, ValueError) as e:  # ValueError: a long template is not a valid path on every OS
        if isinstance(value, Path) or not any(c in str(value) for c in _JINJA_CHARS):
            raise ValueError(f"chat_template {str(value)!r} looks like a file path, but it could not be read: "
                             f"{e}") from None
        # Non-Latin-1 characters become \\uXXXX first, so unicode_escape gives them back unchanged.
        text = codecs.decode(str(value).encode("latin-1", "backslashreplace"), "unicode_escape")
    _check_syntax(text)
    return text


def _check_syntax(text: str) -> None:
    # Parse only (the template runs per request in transformers' sandbox); loopcontrols as transformers enables it.
    from jinja2 import Environment, TemplateSyntaxError

    try:
        Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"chat_template is not a valid Jinja template: {e} (line {e.lineno})") from None


# Every chat template renders under this limit: a request's own (chat_render.py) and the model's, which is also
# third-party code (a GGUF file's tokenizer.chat_template with two nested loops of 100,000 never returned).
TEMPLATE_TIME_LIMIT_S = 5.0


class TemplateTimeout(Exception):
    """A chat template ran past its time limit and was stopped."""


def run_with_time_limit(fn: Callable[[], T], seconds: float) -> T:
    """fn() in this thread, stopped once it has run `seconds`: a trace function on the compiled template's frames
    (Jinja compiles templates to Python, file name "<template>") raises inside them past the deadline.  Only those
    frames are traced line by line; the rest of the call runs at full speed."""
    deadline = time.monotonic() + seconds

    def local(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise TemplateTimeout(f"the chat template ran longer than {seconds:g} s and was stopped")
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        return fn()
    finally:
        sys.settrace(previous)


