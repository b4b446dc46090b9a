"""Tool-call parsers (`--tool-call-parser NAME`, vLLM's names), one file each behind `base.ToolParser`."""

from __future__ import annotations

from tokenspout.tool_parsers.base import ParsedCall, ToolParse, ToolParser
from tokenspout.tool_parsers.hermes import HermesToolParser
from tokenspout.tool_parsers.llama3_json import Llama3JsonToolParser
from tokenspout.tool_parsers.mistral import MistralToolParser
from tokenspout.tool_parsers.pythonic import PythonicToolParser
from tokenspout.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from tokenspout.tool_parsers.stream import ToolCallStream

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser,
                          Qwen3CoderToolParser)
}
# What in a chat template's text tells which format its model was trained on (checked in this order).
_TEMPLATE_SIGNS = (("<function=", "qwen3_coder"), ("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
                   ("[func_name1(", "pythonic"), ('"parameters"', "llama3_json"))


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable (else tool definitions would never reach the model)."""
    if not template:
        return False
    from jinja2 import Environment, meta

    try:
        names = meta.find_undeclared_variables(Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template))
    except Exception:  # noqa: BLE001 - a template jinja cannot parse renders nothing either
        return False
    return "tools" in names


def resolve_tool_parser(name: str | None, template: str | None) -> ToolParser | None:
    """The parser for `--tool-call-parser NAME`; "auto" picks by the chat template's text (None when it cannot
    tell); None for None.  Unknown names are a ValueError listing the known ones."""
    if name is None:
        return None
    if name == "auto":
        for sign, parser in _TEMPLATE_SIGNS:
            if template and sign in template:
                return TOOL_PARSERS[parser]()
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of auto, {', '.join(TOOL_PARSERS)}; got {name!r}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ParsedCall", "ToolCallStream", "ToolParse", "ToolParser", "resolve_tool_parser",
           "template_renders_tools"]
