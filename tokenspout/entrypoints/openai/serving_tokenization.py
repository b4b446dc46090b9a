"""POST /tokenize, POST /detokenize, GET /tokenizer_info and GET /version, in vLLM's shapes.

/tokenize takes a text prompt (`add_special_tokens` defaults to True: the tokenizer's rule, as a completion prompt
is encoded) or chat messages (rendered by render_chat_prompt exactly as /v1/chat/completions renders them, and
encoded with `add_special_tokens` False by default, as a chat prompt is: the template writes BOS itself), so its
`count` is the chat completion's usage.prompt_tokens.  Unlike generation, a prompt longer than the context is
still counted (the answer carries max_model_len to compare with).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator
from starlette.responses import Response

from tokenspout.engine.chat_tools import effective_template, plan_chat, template_tool_messages, tools_template
from tokenspout.entrypoints.openai.chat_render import check_request_template, render_chat_prompt, request_template
from tokenspout.entrypoints.openai.json_body import JsonBodyRoute
from tokenspout.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    OpenAIServingError,
    validation_error_to_serving_error,
    value_error_to_serving_error,
)
from tokenspout.entrypoints.openai.protocol.bounds import check_sizes
from tokenspout.entrypoints.openai.serving_common import EngineClient, check_model
from tokenspout.offload import Offloader

logger = logging.getLogger(__name__)


class _Request(BaseModel):
    # unknown fields are a 400 naming them, as on the OpenAI routes (a body with both `prompt` and `messages` too)
    model_config = ConfigDict(extra="forbid")


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(default=True, description="Add the tokenizer's special tokens (e.g. BOS).")
    return_token_strs: bool | None = Field(default=False, description="Also return each token id's string.")


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = Field(default=True, description="End with the assistant's turn header.")
    continue_final_message: bool = Field(
        default=False, description="Leave the last message open (prefill); excludes add_generation_prompt.")
    add_special_tokens: bool = Field(
        default=False, description="Add the tokenizer's special tokens on top of what the chat template writes.")
    chat_template: str | None = Field(
        default=None, description="The request's own template (needs --trust-request-chat-template), as on chat.")
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = Field(default=None, description="Rendered as the chat route renders them.")
    return_token_strs: bool | None = Field(default=False, description="Also return each token id's string.")

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        check_sizes(data, {"messages": "messages", "tools": "tools"})
        return data

    @model_validator(mode="after")
    def _generation_prompt(self) -> TokenizeChatRequest:
        # vLLM's rule: only an explicit add_generation_prompt=true clashes; its default yields to continuation
        if self.continue_final_message and self.add_generation_prompt and \
                "add_generation_prompt" in self.model_fields_set:
            raise ValueError("continue_final_message cannot be used with add_generation_prompt=true")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def tokenspout_version() -> str:
    try:
        return importlib.metadata.version("tokenspout")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree without an install
        return "0+unknown"


class _OpenAIErrorRoute(JsonBodyRoute):
    """Body validation errors as a 400 in OpenAI's shape naming the field, like the other routes (not FastAPI's
    422).  The body is re-validated against the one model its keys select, so a union's errors do not pile up."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        models = _BODY_MODELS.get(self.path, ())

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                raise await _serving_error(request, e, models) from None

        return route


async def _serving_error(request: Request, exc: RequestValidationError,
                         models: tuple[type[BaseModel], ...]) -> OpenAIServingError:
    try:
        data = await request.json()
    except ValueError as e:
        return OpenAIServingError(f"request body is not valid JSON: {e}")
    if not isinstance(data, dict):
        return OpenAIServingError(f"request body must be a JSON object, got {type(data).__name__}")
    model = models[-1] if "messages" in data and len(models) > 1 else models[0] if models else None
    if model is not None:
        try:
            model.model_validate(data)
        except ValidationError as e:
            return validation_error_to_serving_error(e)
    return OpenAIServingError(str(exc))


_BODY_MODELS: dict[str, tuple[type[BaseModel], ...]] = {
    "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest),
    "/detokenize": (DetokenizeRequest,),
}


_JSON_CHUNK = 1 << 16  # token ids serialized per GIL-holding call


def _json(model: BaseModel) -> Response:
    if isinstance(model, TokenizeResponse) and len(model.tokens) > _JSON_CHUNK and model.token_strs is None:
        return Response(content=_tokens_json(model), media_type="application/json")
    return Response(content=model.model_dump_json(), media_type="application/json")


def _tokens_json(r: TokenizeResponse) -> bytes:
    """The same JSON as model_dump_json, with the ids written 65,536 at a time: pydantic serializes a 1.8M-id list
    in one call that holds the GIL (~0.2 s), stalling the event loop's streams and /health for that long."""
    head = r.model_copy(update={"tokens": []}).model_dump_json().encode()
    before, after = head.split(b'"tokens":[]', 1)
    chunks = [",".join(map(str, r.tokens[i:i + _JSON_CHUNK])).encode() for i in range(0, len(r.tokens), _JSON_CHUNK)]
    return before + b'"tokens":[' + b",".join(chunks) + b"]" + after


def _token_strs(tokenizer: Any, ids: list[int]) -> list[str]:
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is not None:
        return [str(t) for t in convert(ids)]
    return [tokenizer.decode([t]) for t in ids]


def _vocab_size(engine: EngineClient) -> int:
    """The model's vocabulary (what the engine accepts), else the tokenizer's with its added tokens."""
    size = getattr(engine, "vocab_size", None)
    if size is None:
        tok = engine.tokenizer
        size = len(tok) if hasattr(tok, "__len__") else tok.vocab_size
    return int(size)


def tokenize(engine: EngineClient, req: TokenizeCompletionRequest | TokenizeChatRequest,
             trusted: bool = False) -> TokenizeResponse:
    """`trusted`: --trust-request-chat-template (a template inside chat_template_kwargs is refused without it)."""
    check_model(engine, req.model)
    if isinstance(req, TokenizeChatRequest):
        # Through ChatCompletionRequest so the messages are flattened by the very code the chat route runs.
        chat = ChatCompletionRequest(messages=req.messages, tools=req.tools)
        kwargs = dict(req.chat_template_kwargs or {})
        messages = chat.template_messages()
        # the chat route's choice for these tools (none when the request brings a template of its own)
        own = request_template(req.chat_template, kwargs)
        check_request_template(own, trusted)
        fallback = None if own is not None else tools_template(engine, None, req.tools)
        if req.tools:  # as the chat route renders them (tool_choice "none": only a template that reads them)
            messages = template_tool_messages(messages)
            try:
                plan_chat(chat.tool_dicts(), "none", None, template=effective_template(engine, own or fallback),
                          parser_name=None, template_kwargs=kwargs)
            except ValueError as e:  # e.g. two tools of one name, as the chat route says
                raise value_error_to_serving_error(e, {"tools"}) from None
        text = render_chat_prompt(engine, messages, add_generation_prompt=req.add_generation_prompt,
                                  continue_final_message=req.continue_final_message, chat_template_kwargs=kwargs,
                                  chat_template=req.chat_template, trusted=trusted, server_template=fallback)
    else:
        text = req.prompt
    ids = [int(t) for t in engine.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)]
    strs = _token_strs(engine.tokenizer, ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)


def detokenize(engine: EngineClient, req: DetokenizeRequest) -> DetokenizeResponse:
    check_model(engine, req.model)
    vocab = _vocab_size(engine)
    for i, t in enumerate(req.tokens):
        if not 0 <= t < vocab:
            raise OpenAIServingError(f"tokens.{i}: token id {t} is outside the vocabulary [0, {vocab})",
                                     param=f"tokens.{i}")
    return DetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens))


# Tokenizer settings that name files or folders of the server's machine: not sent.
_LOCAL_KEYS = {"name_or_path", "vocab_file", "merges_file", "tokenizer_file", "is_local", "local_files_only",
               "cache_dir"}


def _json_safe(value: Any) -> Any:
    """A tokenizer setting as JSON: AddedToken objects as their text, containers walked, anything else left out
    (None)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    content = getattr(value, "content", None)
    if isinstance(content, str):  # an AddedToken
        return content
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    return None


def tokenizer_info(engine: EngineClient) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's class and settings (tokenizer_config.json's), its added tokens with
    their flags, and the chat template the server renders with."""
    tok = engine.tokenizer
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
    for key, value in dict(getattr(tok, "init_kwargs", None) or {}).items():
        if key in _LOCAL_KEYS or key in ("added_tokens_decoder", "chat_template"):
            continue
        safe = _json_safe(value)
        if safe is not None or value is None:
            info[key] = safe
    added = getattr(tok, "added_tokens_decoder", None) or {}
    info["added_tokens_decoder"] = {
        str(i): {"content": t.content, **{flag: bool(getattr(t, flag, False))
                                          for flag in ("single_word", "lstrip", "rstrip", "normalized", "special")}}
        for i, t in added.items()}
    info["chat_template"] = effective_template(engine, None)
    return info


def tokenization_router(get_engine: Callable[[Request], EngineClient],
                        get_offloader: Callable[[Request], Offloader]) -> APIRouter:
    """The routes; `get_engine(request)` finds the engine (it may be built at startup, after the app), and
    `get_offloader(request)` the worker that renders and tokenizes off the event loop."""
    router = APIRouter(route_class=_OpenAIErrorRoute)

    @router.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize_route(request: Request, body: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
        engine = get_engine(request)
        trusted = bool(getattr(request.app.state, "trust_request_chat_template", False))
        return await get_offloader(request).run(lambda: _json(tokenize(engine, body, trusted)))  # + JSON: 7M ids

    @router.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize_route(request: Request, body: DetokenizeRequest) -> Response:
        engine = get_engine(request)
        return await get_offloader(request).run(lambda: _json(detokenize(engine, body)))

    @router.get("/tokenizer_info")
    async def tokenizer_info_route(request: Request) -> Response:
        engine = get_engine(request)
        return await get_offloader(request).run(
            lambda: Response(content=json.dumps(tokenizer_info(engine)), media_type="application/json"))

    @router.get("/version", response_model=VersionResponse)
    async def version() -> Response:
        return _json(VersionResponse(version=tokenspout_version()))

    return router


def install_tokenization_routes(app: FastAPI) -> None:
    """build_app's hook."""
    app.include_router(tokenization_router(lambda request: request.app.state.server.engine,
                                           lambda request: request.app.state.server.prep))
