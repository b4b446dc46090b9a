"""What a chat request's `tools`, `tool_choice`, `parallel_tool_calls` and the reasoning parser imply, shared by
the server and the offline `LLM.chat`: which tools reach the template, which parser reads the reply, and the
grammar (llguidance) that constrains the calls.

Constrained calls: with tool_choice "required" or a named function the reply is calls only, each an object
{"name", "arguments"} whose arguments follow the function's `parameters` schema; with "auto" the text is free
until the parser's start marker, then the call is constrained the same way (a lazy grammar).  "none" renders the
tools (when the template can) but neither parses nor constrains.  With a reasoning parser the grammar applies
only after the reasoning's end marker.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenspout.engine.chat_output import ChatOutputParser
from tokenspout.outputs import MessageParts
from tokenspout.reasoning import ReasoningParser, reasoning_parser_class
from tokenspout.sampling_params import SamplingParams, StructuredOutputsParams
from tokenspout.structured_output import validate as validate_grammar
from tokenspout.tool_parsers import ToolParser, resolve_tool_parser, template_renders_tools

ToolChoice = str | Mapping[str, Any] | None


@dataclass(slots=True)
class ChatPlan:
    tool_parser: ToolParser | None = None  # None: the reply is not parsed for calls
    reasoning: ReasoningParser | None = None
    parallel: bool = True
    # tool_choice "required" or a named function: the grammar allows calls only, so text outside them (a call cut
    # off before its name was complete) is no content
    calls_only: bool = False

    def output_parser(self) -> ChatOutputParser:
        return ChatOutputParser(self.tool_parser, self.reasoning, self.calls_only)

    def final(self, text: str) -> MessageParts:
        """The whole reply's parts; with parallel_tool_calls false, one call at most."""
        parts = self.output_parser().final(text)
        if not self.parallel:
            parts.tool_calls = parts.tool_calls[:1]
        return parts

    @property
    def active(self) -> bool:
        return self.tool_parser is not None or self.reasoning is not None


def choice_kind(tool_choice: ToolChoice, has_tools: bool) -> str:
    """"none" | "auto" | "required" | "named"; OpenAI's default is "auto" with tools, "none" without."""
    if tool_choice is None:
        return "auto" if has_tools else "none"
    if isinstance(tool_choice, str):
        return tool_choice
    return "named"


_CHOICES = ("none", "auto", "required")


def check_shapes(tools: Any, tool_choice: Any) -> None:
    """OpenAI's shapes of `tools` and `tool_choice`, for callers no request model checked (the offline LLM.chat: a
    tool_choice "sometimes" was ignored, a tool without "function" was a KeyError); ValueErrors name the field."""
    if tools is not None and (not isinstance(tools, Sequence) or isinstance(tools, str)):
        raise ValueError(f"tools: expected a list of function tools, got {type(tools).__name__}")
    for i, t in enumerate(tools or []):
        f = t.get("function") if isinstance(t, Mapping) and t.get("type") == "function" else None
        if not isinstance(f, Mapping) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ..., "
                             f"'parameters': {{...}}}}}}, got {str(t)[:200]}")
        if not isinstance(f.get("parameters", {}) or {}, Mapping):
            raise ValueError(f"tools[{i}].function.parameters: expected a JSON schema object")
    if tool_choice is None or tool_choice in _CHOICES:
        return
    f = tool_choice.get("function") if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function" \
        else None
    if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
        raise ValueError(f"tool_choice: expected one of {', '.join(_CHOICES)} or {{'type': 'function', 'function': "
                         f"{{'name': ...}}}}, got {str(tool_choice)[:200]}")


def selected_tools(tools: Sequence[Mapping[str, Any]] | None, tool_choice: ToolChoice) -> list[Mapping[str, Any]]:
    """The tools the reply may call; ValueErrors name the field."""
    check_shapes(tools, tool_choice)
    tools = list(tools or [])
    kind = choice_kind(tool_choice, bool(tools))
    if kind in ("required", "named") and not tools:
        raise ValueError(f"tool_choice: {kind!r} needs a non-empty 'tools' list")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: function names must be unique, got {names}")
    if kind == "named":
        assert isinstance(tool_choice, Mapping)
        name = tool_choice["function"]["name"]
        if name not in names:
            raise ValueError(f"tool_choice: function {name!r} is not one of the tools ({', '.join(names)})")
        return [t for t in tools if t["function"]["name"] == name]
    return tools


def template_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant `tool_calls` as chat templates read them: `arguments` as an object (OpenAI sends a JSON string;
    Llama's and Qwen's templates write `arguments | tojson`), as vLLM does.  Arguments that are not JSON stay text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for call in calls:
                fn = call.get("function") if isinstance(call, Mapping) else None
                if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
                    try:
                        fn = {**fn, "arguments": json.loads(fn["arguments"])}
                    except ValueError:
                        pass
                    call = {**call, "function": fn}
                fixed.append(call)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def plan_chat(tools: Sequence[Mapping[str, Any]] | None, tool_choice: ToolChoice, parallel: bool | None, *,
              template: str | None, parser_name: str | None, template_kwargs: dict[str, Any]) -> ChatPlan:
    """The plan of a chat request's reply (its reasoning parser is the caller's to set); adds `tools` to
    `template_kwargs` when the template renders them.  ValueErrors name the field."""
    parser, renders = plan_tools(tools, tool_choice, template=template, parser_name=parser_name)
    if renders:
        template_kwargs["tools"] = list(tools or [])
    return ChatPlan(parser, None, parallel is not False,
                    calls_only=parser is not None and choice_kind(tool_choice, True) in ("required", "named"))


def plan_tools(tools: Sequence[Mapping[str, Any]] | None, tool_choice: ToolChoice, *,
               template: str | None, parser_name: str | None) -> tuple[ToolParser | None, bool]:
    """(the parser that reads the reply, whether the template gets `tools=`).  ValueErrors name the field."""
    selected_tools(tools, tool_choice)  # checks tool_choice against tools
    if not tools:
        return None, False
    renders = template_renders_tools(template)
    if choice_kind(tool_choice, True) == "none":
        return None, renders
    if not renders:
        raise ValueError("tools: the chat template does not render tools (it never reads the 'tools' variable), "
                         "so the model would never see them; start the server with --chat-template FILE (a "
                         "template that renders tools) and --tool-call-parser NAME, or send 'chat_template'")
    parser = resolve_tool_parser(parser_name, template)
    if parser is not None:
        parser.bind_tools(tools)
    if parser is None:
        reason = "the server was started without --tool-call-parser" if parser_name is None else \
            "--tool-call-parser auto cannot tell the tool-call format from the chat template"
        raise ValueError(f"tools: {reason}; start it with --tool-call-parser hermes, llama3_json, mistral, "
                         f"pythonic or qwen3_coder")
    return parser, True


def constrain(params: SamplingParams, parser: ToolParser | None, tools: Sequence[Mapping[str, Any]] | None,
              tool_choice: ToolChoice, parallel: bool | None, reasoning: ReasoningParser | None,
              special_token_ids: Mapping[str, int]) -> None:
    """Sets the tool grammar (and the reasoning prefix of any grammar) on `params`, in place."""
    if parser is not None:
        if params.structured_outputs is not None:
            raise ValueError("response_format: structured outputs cannot be combined with tool calls; send "
                             "tool_choice 'none' or drop response_format / guided_* / structured_outputs")
        kind = choice_kind(tool_choice, True)
        grammar = parser.grammar(selected_tools(tools, tool_choice), required=kind != "auto",
                                 parallel=parallel is not False, special_token_ids=special_token_ids)
        params.structured_outputs = StructuredOutputsParams(grammar=grammar)
        try:  # here, so the 400 names the tools rather than a grammar the client never wrote
            validate_grammar(params.structured_outputs)
        except ValueError as e:
            raise ValueError(f"tools: a function's parameters schema cannot be enforced: "
                             f"{str(e).split(': ', 1)[-1]}") from None
        if parser.needs_special_tokens:
            params.skip_special_tokens = False  # its markers are special tokens
    if reasoning is not None and params.structured_outputs is not None and not reasoning.starts_in_answer():
        params.structured_outputs = dataclasses.replace(params.structured_outputs, reasoning_end=reasoning.end_marker,
                                                        reasoning_start=reasoning.optional_start)


def check_parser_names(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """Unknown --tool-call-parser / --reasoning-parser names fail at startup (ValueError listing the known)."""
    if tool_call_parser not in (None, "auto"):
        resolve_tool_parser(tool_call_parser, None)
    reasoning_parser_class(reasoning_parser)


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """Special tokens by text (the tool grammars reference a marker that is one by its id)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {tok.content: i for i, tok in decoder.items() if getattr(tok, "special", False)}


def effective_template(engine_or_processor: Any, request_template: str | None) -> str | None:
    """The template a chat request renders with: its own, else --chat-template, else the tokenizer's."""
    if request_template:
        return request_template
    processor = getattr(engine_or_processor, "processor", engine_or_processor)
    template = getattr(processor, "chat_template", None) or getattr(processor.tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


_CHATML_TOOLS = Path(__file__).resolve().parent.parent / "tool_parsers" / "templates" / "chatml_tools.jinja"


@functools.cache
def chatml_tools_template() -> str:
    """ChatML with Hermes-style tool calling (Qwen2.5's way of rendering tools), bundled with the package."""
    return _CHATML_TOOLS.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=16)
def _chatml_without_tools(template: str) -> bool:
    return "<|im_start|>" in template and not template_renders_tools(template)


def tools_template(engine_or_processor: Any, request_template: str | None, tools: Sequence[Any] | None) -> str | None:
    """The template a chat request renders with, given its own (`request_template`) and its `tools`: a request
    with tools whose template is ChatML that never renders them (SmolLM2's: the default model's, so `make serve`
    would refuse every agent) gets the bundled ChatML tools template, whose Hermes calls the `auto` parser reads.
    Anything else keeps the usual choice (None: --chat-template, else the model's)."""
    if request_template or not tools:
        return request_template
    template = effective_template(engine_or_processor, None)
    if template is not None and _chatml_without_tools(template):
        return chatml_tools_template()
    return None
