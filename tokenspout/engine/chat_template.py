"""--chat-template: a path to a Jinja file, or the template text itself (vLLM's rule), read once at startup."""

from __future__ import annotations

import codecs
import logging
from pathlib import Path

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
