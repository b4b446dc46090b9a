"""Chat messages -> prompt text, shared by /v1/chat/completions and /tokenize so both count the same tokens."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenspout.entrypoints.openai.protocol import OpenAIServingError
from tokenspout.entrypoints.openai.serving_common import EngineClient


def render_chat_prompt(engine: EngineClient, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                       continue_final_message: bool = False,
                       chat_template_kwargs: Mapping[str, Any] | None = None, chat_template: str | None = None) -> str:
    """The engine's chat template over `messages` (already flattened by template_messages()).  With
    continue_final_message the last message is left open and no generation prompt is added (vLLM's rule).
    `chat_template`: the request's own template, which wins over --chat-template and the model's."""
    kwargs = dict(chat_template_kwargs or {})
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        return engine.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt and not continue_final_message, **kwargs
        )
    except (ValueError, TypeError) as e:
        raise OpenAIServingError(f"messages could not be rendered with the chat template: {e}",
                                 param="messages") from None
