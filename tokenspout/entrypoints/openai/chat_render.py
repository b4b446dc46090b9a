"""Chat messages -> prompt text, shared by /v1/chat/completions and /tokenize so both count the same tokens.

A request may bring its own Jinja chat template (`chat_template`, or `chat_template` inside
`chat_template_kwargs`): that is code the server runs, so it is refused unless the server was started with
--trust-request-chat-template (vLLM's flag).  Trusted, it renders in transformers' Jinja sandbox (no attribute
access to Python internals, ranges of at most 100,000) under a time limit: a template whose loops run past
REQUEST_TEMPLATE_TIME_LIMIT_S is stopped and the request is a 400.  The server's own template (the model's, or
--chat-template) renders under the same limit in the engine's processor: past it, a 500.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenspout.engine.chat_template import TEMPLATE_TIME_LIMIT_S, TemplateTimeout, run_with_time_limit
from tokenspout.entrypoints.openai.protocol import OpenAIServingError
from tokenspout.entrypoints.openai.serving_common import EngineClient

REQUEST_TEMPLATE_TIME_LIMIT_S = TEMPLATE_TIME_LIMIT_S


def request_template(chat_template: str | None, chat_template_kwargs: Mapping[str, Any] | None) -> str | None:
    """The template a request brings, from either place it can put one."""
    if chat_template is not None:
        return chat_template
    inner = (chat_template_kwargs or {}).get("chat_template")
    return inner if inner is not None else None


def check_request_template(template: str | None, trusted: bool) -> None:
    if template is not None and not trusted:
        raise OpenAIServingError(
            "Chat template is passed with the request, but --trust-request-chat-template is not set: refused "
            "(a request's Jinja template is code the server runs; use the server's template)", param="chat_template")


def render_chat_prompt(engine: EngineClient, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                       continue_final_message: bool = False,
                       chat_template_kwargs: Mapping[str, Any] | None = None, chat_template: str | None = None,
                       trusted: bool = False, server_template: str | None = None) -> str:
    """The engine's chat template over `messages` (already flattened by template_messages()).  With
    continue_final_message the last message is left open and no generation prompt is added (vLLM's rule).
    `chat_template`: the request's own template, which wins over --chat-template and the model's; refused unless
    `trusted`, and then run under the time limit (module docstring).  `server_template`: a template the server
    chose for this request (the bundled tools template: chat_tools.tools_template), used when the request brings
    none; the server's own code, so neither checked nor limited."""
    own = request_template(chat_template, chat_template_kwargs)
    check_request_template(own, trusted)
    kwargs = dict(chat_template_kwargs or {})
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    elif own is None and server_template is not None:
        kwargs["chat_template"] = server_template
    if continue_final_message:
        kwargs["continue_final_message"] = True

    def render() -> str:
        return engine.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt and not continue_final_message, **kwargs
        )

    try:
        return run_with_time_limit(render, REQUEST_TEMPLATE_TIME_LIMIT_S) if own is not None else render()
    except TemplateTimeout:
        if own is None:  # the server's own (or the model's) template: not the client's to fix
            raise OpenAIServingError(f"the model's chat template ran longer than {TEMPLATE_TIME_LIMIT_S:g} s and "
                                     "was stopped", status=500) from None
        raise OpenAIServingError(f"the request's chat template ran longer than {REQUEST_TEMPLATE_TIME_LIMIT_S:g} s "
                                 "and was stopped", param="chat_template") from None
    except (OverflowError, RecursionError, MemoryError) as e:  # the sandbox's range bound, runaway recursion
        raise OpenAIServingError(f"the request's chat template failed: {type(e).__name__}: {e}",
                                 param="chat_template") from None
    except (ValueError, TypeError) as e:
        raise OpenAIServingError(f"messages could not be rendered with the chat template: {e}",
                                 param="messages") from None
