"""The OpenAI-compatible HTTP server: FastAPI app factory, uvicorn runner, and a background-thread server for tests.

Endpoints: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (+ GET / DELETE
/v1/responses/{id}: serving_responses.py), POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages
API: entrypoints/anthropic/), GET /v1/models, GET /health (503 once the engine is
dead), GET /metrics (Prometheus text), POST /tokenize, POST /detokenize, GET /version (serving_tokenization.py).
Optional API-key auth and CORS, and X-Request-Id on every response: middleware.py.  Every error is answered in
Anthropic's shape `{"type": "error", "error": {"type", "message"}}` on the /v1/messages routes, elsewhere in
OpenAI's shape `{"error": {"message", "type", "param", "code"}}`; bad input (malformed JSON, unknown fields
included) is a 400, never a 422; a body that is not `application/json` is a 415.  Request and response bodies are
described in /openapi.json.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from tokenspout.engine.chat_tools import check_parser_names
from tokenspout.entrypoints.anthropic import protocol as anthropic
from tokenspout.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from tokenspout.entrypoints.openai.limits import RETRY_AFTER_S, AdmissionGate, BodyLimitMiddleware, ServerLimits
from tokenspout.entrypoints.openai.middleware import install_middleware
from tokenspout.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    OpenAIServingError,
    StreamOptions,
    validation_error_to_serving_error,
)
from tokenspout.entrypoints.openai.protocol.responses import ResponseDeleted, ResponseObject, ResponsesRequest
from tokenspout.entrypoints.openai.responses_store import (
    DEFAULT_MAX_STORED_BYTES,
    DEFAULT_MAX_STORED_RESPONSES,
    ResponseStore,
)
from tokenspout.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenspout.entrypoints.openai.serving_responses import OpenAIServingResponses
from tokenspout.entrypoints.openai.serving_common import EngineClient
from tokenspout.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenspout.entrypoints.openai.serving_tokenization import install_tokenization_routes
from tokenspout.entrypoints.openai.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S, Drain, DrainingServer, graceful_config
from tokenspout.entrypoints.openai.sse import ClientDisconnected, SSEResponse, run_until_disconnect
from tokenspout.metrics import DEFAULT_PREFIX, PROMETHEUS_CONTENT_TYPE, ServerMetrics, check_prefix
from tokenspout.entrypoints.openai.json_body import JsonBodyRoute
from tokenspout.offload import Offloader
from tokenspout.platform import freeze_startup_heap, return_large_frees_to_the_os
from tokenspout.playground import install_playground

logger = logging.getLogger(__name__)

EngineOrFactory = EngineClient | Callable[[], EngineClient]


@dataclass(slots=True)
class ServerState:
    engine: EngineClient
    metrics: ServerMetrics
    chat: OpenAIServingChat
    completion: OpenAIServingCompletion
    gate: AdmissionGate
    prep: Offloader  # request preparation (chat templates, grammars) off the event loop
    drain: Drain  # the shutdown deadline (shutdown.py)
    responses: OpenAIServingResponses  # /v1/responses: a translation onto `chat`
    messages: AnthropicServingMessages  # /v1/messages (Anthropic): a translation onto `chat`


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(content=model.model_dump_json(), status_code=status, media_type="application/json")


def _error(err: OpenAIServingError, path: str = "") -> Response:
    """The error in OpenAI's shape, or Anthropic's on the Messages routes (each client parses its own)."""
    body = anthropic.error_response(err) if anthropic.is_anthropic_path(path) else err.to_response()
    response = _json(body, err.status)
    if err.status == HTTPStatus.SERVICE_UNAVAILABLE:
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def num_prompts(prompt: Any) -> int:
    """The prompts of a completions request's `prompt` (a string, a list of ids, or a list of either), counted
    before it is validated: what admission charges for it."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def _is_engine(obj: Any) -> bool:
    return not isinstance(obj, type) and hasattr(obj, "generate")  # else a factory (a class, function, partial)


def _install(app: FastAPI, engine: EngineClient, metrics: ServerMetrics | None, record_request_metrics: bool,
             metrics_prefix: str = DEFAULT_PREFIX, chat_options: dict[str, Any] | None = None,
             limits: ServerLimits = ServerLimits(), drain: Drain | None = None,
             store: ResponseStore | None = None) -> None:
    if metrics is None:  # share the engine frontend's metrics object when it has one
        engine_metrics = getattr(engine, "metrics", None)
        metrics = engine_metrics if isinstance(engine_metrics, ServerMetrics) else ServerMetrics(
            engine.model_name, prefix=metrics_prefix, max_model_len=getattr(engine, "max_model_len", None))
    app.state.detach_metrics = metrics.attach_engine(engine)
    request_metrics = metrics if record_request_metrics else None
    prep = Offloader("tokenspout-prepare")  # request preparation, and the building of finished responses
    chat = OpenAIServingChat(engine, request_metrics, offloader=prep, **(chat_options or {}))
    app.state.server = ServerState(
        engine, metrics, chat, OpenAIServingCompletion(engine, request_metrics, offloader=prep),
        AdmissionGate(limits), prep, drain or Drain(),
        OpenAIServingResponses(chat, store if store is not None else ResponseStore()), AnthropicServingMessages(chat),
    )


async def _require_json(request: Request) -> None:
    """As vLLM: a body in any other media type is a 415 (a form-encoded body must not be half-understood)."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise OpenAIServingError(
            f"Unsupported Media Type: {media or 'no Content-Type'}; only 'application/json' is allowed",
            status=HTTPStatus.UNSUPPORTED_MEDIA_TYPE)


def build_app(
    engine: EngineOrFactory,
    *,
    metrics: ServerMetrics | None = None,
    record_request_metrics: bool = True,
    owns_engine: bool | None = None,
    api_key: str | Sequence[str] | None = None,
    allowed_origins: Sequence[str] | None = None,
    allowed_methods: Sequence[str] = ("*",),
    allowed_headers: Sequence[str] = ("*",),
    allow_credentials: bool = False,
    metrics_prefix: str = DEFAULT_PREFIX,
    tool_call_parser: str | None = "auto",
    reasoning_parser: str | None = None,
    playground: bool = True,
    limits: ServerLimits = ServerLimits(),
    trust_request_chat_template: bool = False,
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
    max_stored_response_bytes: int = DEFAULT_MAX_STORED_BYTES,
    force_include_usage: bool = False,
    return_tokens_as_token_ids: bool = False,
) -> FastAPI:
    """`engine`: a constructed AsyncLLM (or anything meeting EngineClient), or a zero-argument factory called in
    the server's event loop at startup (for engines that bind to the running loop).  `owns_engine` (default: True
    for a factory, False for an instance): call engine.shutdown() when the server stops.  `metrics`: defaults to
    `engine.metrics` when that is a ServerMetrics, else a fresh one.  `record_request_metrics=False` when the engine
    frontend records request-level metrics itself.  `api_key` (one or several; None: open) and the CORS settings
    (`allowed_origins` None: no CORS): see middleware.install_middleware.  `metrics_prefix`: the families' prefix
    ("vllm" for vLLM's dashboards) when the metrics object is made here.  `tool_call_parser` / `reasoning_parser`:
    --tool-call-parser / --reasoning-parser (see engine/chat_tools.py).  `playground`: serve the playground page at
    / and /playground (--no-playground turns it off).  `limits`: body size, fan-out and admission (limits.py).
    `trust_request_chat_template`: accept a request's own chat template (chat_render.py; refused by default).
    `max_stored_responses` / `max_stored_response_bytes`: the bounds of /v1/responses' store (responses_store.py).
    `force_include_usage` / `return_tokens_as_token_ids` (vLLM's --enable-force-include-usage /
    --return-tokens-as-token-ids): every stream ends with a usage chunk / logprob tokens are "token_id:N", for
    chat and completion requests that do not say otherwise."""
    check_prefix(metrics_prefix)  # a bad prefix fails here, not at the server's start
    check_parser_names(tool_call_parser, reasoning_parser)
    chat_options = {"tool_call_parser": tool_call_parser, "reasoning_parser": reasoning_parser,
                    "trust_request_chat_template": trust_request_chat_template}
    store = ResponseStore(max_stored_responses, max_stored_response_bytes)
    factory = None if _is_engine(engine) else engine
    owns = owns_engine if owns_engine is not None else factory is not None
    drain = Drain()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if factory is not None:
            _install(app, factory(), metrics, record_request_metrics, metrics_prefix, chat_options,  # type: ignore[operator]
                     limits, drain, store)
        supervise = getattr(app.state.server.engine, "start_supervision", None)
        if supervise is not None:  # AsyncLLM: restart a dead or hung engine (or exit, via app.state.on_fatal)
            supervise(lambda reason: getattr(app.state, "on_fatal", logger.error)(reason))
        freeze_startup_heap()
        try:
            yield
        finally:
            if hasattr(app.state, "detach_metrics"):
                app.state.detach_metrics()
            if hasattr(app.state, "server"):
                app.state.server.prep.shutdown()
                if owns:
                    logger.info("shutting down the engine")
                    app.state.server.engine.shutdown()

    app = FastAPI(title="tokenspout", lifespan=lifespan)
    app.router.route_class = JsonBodyRoute  # bodies parsed with the garbage collector paused (json_body.py)
    app.state.drain = drain
    app.state.trust_request_chat_template = trust_request_chat_template
    if factory is None:
        _install(app, engine, metrics, record_request_metrics, metrics_prefix, chat_options,  # type: ignore[arg-type]
                 limits, drain, store)

    def state(request: Request) -> ServerState:
        return request.app.state.server

    @app.exception_handler(OpenAIServingError)
    async def _serving_error(request: Request, exc: OpenAIServingError) -> Response:
        return _error(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error(validation_error_to_serving_error(exc.errors()), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return _error(OpenAIServingError(str(exc.detail), status=exc.status_code), request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return _error(OpenAIServingError(f"internal server error: {type(exc).__name__}", status=500),
                      request.url.path)

    def check_alive(st: ServerState) -> None:
        if st.drain.draining:
            raise OpenAIServingError("The server is shutting down.", status=HTTPStatus.SERVICE_UNAVAILABLE)
        if getattr(st.engine, "recovering", False):
            raise OpenAIServingError("The engine is restarting after a failure; retry shortly.",
                                     status=HTTPStatus.SERVICE_UNAVAILABLE)
        if st.engine.errored:
            raise OpenAIServingError("The engine is dead; the server cannot serve requests.", status=500)

    async def prepare_and_respond(request: Request, serving: Any, req: Any, release: Callable[[], None]) -> Response:
        """Prepares (off the event loop) and runs an admitted request; `release` frees its admission slots when the
        response ends, however.  Admission comes first, from the request's own counts: a refusal is a 503 at once,
        never queued behind other requests' preparation."""
        st = state(request)
        try:
            job = await st.prep.run(serving.prepare, req)
        except BaseException:
            release()
            raise
        if req.stream:
            # each API's own error shapes: the JSON error before the first frame, the frame that ends a stream
            # cut at the shutdown deadline
            render, end = None, getattr(serving, "end_frame", None)
            if anthropic.is_anthropic_path(request.url.path):
                render = anthropic.error_body
            return SSEResponse(serving.stream(job), on_close=release, drain=st.drain, render_error=render,
                               end_frame=end)
        try:
            result = await run_until_disconnect(request.receive, serving.complete(job), st.drain)
        except ClientDisconnected:
            logger.info("client disconnected before the response was ready; request aborted")
            return Response(status_code=499)
        finally:
            release()
        return _json(result)

    # Typed bodies: FastAPI validates them (errors -> 400 via the handler above) and /openapi.json describes them.
    json_only = [Depends(_require_json)]
    errors: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 404, 413, 415, 431,
                                                                                           500, 503)}
    anthropic_errors: dict[int | str, dict[str, Any]] = {code: {"model": anthropic.ErrorResponse}
                                                         for code in (400, 401, 404, 413, 415, 431, 500, 503)}

    def server_defaults(req: ChatCompletionRequest | CompletionRequest) -> None:
        """The server-wide flags, for what the request leaves unsaid."""
        if return_tokens_as_token_ids and "return_tokens_as_token_ids" not in req.model_fields_set:
            req.return_tokens_as_token_ids = True
        if force_include_usage and req.stream and not req.include_usage:
            options = req.stream_options or StreamOptions()
            req.stream_options = options.model_copy(update={"include_usage": True})

    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        st = state(request)
        check_alive(st)
        server_defaults(req)
        release = st.gate.admit(req.n or 1)
        return await prepare_and_respond(request, st.chat, req, release)

    async def complete(req: CompletionRequest, request: Request) -> Response:
        st = state(request)
        check_alive(st)
        server_defaults(req)
        release = st.gate.admit(num_prompts(req.prompt) * (req.n or 1))
        return await prepare_and_respond(request, st.completion, req, release)

    @app.post("/v1/chat/completions", dependencies=json_only,
              responses={200: {"model": ChatCompletionResponse}, **errors})
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await chat(req, request)

    @app.post("/v1/completions", dependencies=json_only, responses={200: {"model": CompletionResponse}, **errors})
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await complete(req, request)

    @app.post("/invocations", dependencies=json_only, responses={200: {"model": ChatCompletionResponse}, **errors})
    async def invocations(request: Request) -> Response:
        """vLLM's (SageMaker's) single route: a body with `messages` is a chat request, one with `prompt` a
        completion request; anything else is a 400."""
        try:
            body = await request.json()
        except ValueError as e:
            raise OpenAIServingError(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict) or ("messages" in body) == ("prompt" in body):
            raise OpenAIServingError("/invocations takes a chat request (with 'messages') or a completion request "
                                     "(with 'prompt')")
        try:
            if "messages" in body:
                return await chat(ChatCompletionRequest.model_validate(body), request)
            return await complete(CompletionRequest.model_validate(body), request)
        except ValidationError as e:
            raise validation_error_to_serving_error(e) from None

    @app.post("/v1/responses", dependencies=json_only, responses={200: {"model": ResponseObject}, **errors})
    async def create_response(req: ResponsesRequest, request: Request) -> Response:
        st = state(request)
        check_alive(st)
        return await prepare_and_respond(request, st.responses, req, st.gate.admit(1))

    @app.get("/v1/responses/{response_id}", responses={200: {"model": ResponseObject}, **errors})
    async def get_response(response_id: str, request: Request) -> Response:
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            # (the openai client's retrieve(stream=True) would read a JSON body as a stream of no events)
            raise OpenAIServingError("stream: a stored response is retrieved whole; replaying its events is not "
                                     "supported", param="stream")
        return Response(content=state(request).responses.retrieve(response_id), media_type="application/json")

    @app.delete("/v1/responses/{response_id}", responses={200: {"model": ResponseDeleted}, **errors})
    async def delete_response(response_id: str, request: Request) -> Response:
        return _json(state(request).responses.delete(response_id))

    @app.post(anthropic.ROUTE, dependencies=json_only,
              responses={200: {"model": anthropic.MessagesResponse}, **anthropic_errors})
    async def create_message(req: anthropic.MessagesRequest, request: Request) -> Response:
        st = state(request)
        check_alive(st)
        return await prepare_and_respond(request, st.messages, req, st.gate.admit(1))

    @app.post(anthropic.ROUTE + "/count_tokens", dependencies=json_only,
              responses={200: {"model": anthropic.CountTokensResponse}, **anthropic_errors})
    async def count_message_tokens(req: anthropic.CountTokensRequest, request: Request) -> Response:
        st = state(request)
        return _json(await st.prep.run(st.messages.count_tokens, req))

    if playground:
        install_playground(app)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        engine = state(request).engine
        card = ModelCard(id=engine.model_name, root=engine.model_name, max_model_len=engine.max_model_len)
        return _json(ModelList(data=[card]))

    @app.get("/health")
    async def health(request: Request) -> Response:
        engine = state(request).engine
        try:
            if engine.errored:
                raise RuntimeError("engine is dead")
            await engine.check_health()
        except RuntimeError as e:  # EngineDeadError is one
            return _error(OpenAIServingError(f"unhealthy: {e}", status=HTTPStatus.SERVICE_UNAVAILABLE))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        st = state(request)
        snapshot = getattr(st.engine, "get_metrics_snapshot", None)
        if snapshot is not None:
            try:
                st.metrics.update_from_snapshot(snapshot())
                engines = getattr(st.engine, "get_engine_snapshots", None)
                if engines is not None:
                    st.metrics.update_engines(engines())
            except Exception:  # a scrape must not fail because the engine is gone
                logger.warning("could not read the engine's metrics snapshot", exc_info=True)
        return Response(content=st.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    install_tokenization_routes(app)
    install_middleware(app, api_key=api_key, allowed_origins=allowed_origins, allowed_methods=allowed_methods,
                       allowed_headers=allowed_headers, allow_credentials=allow_credentials)
    # outermost: before any body is read
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_body_bytes, max_header_bytes=limits.max_header_bytes,
                       bounds=dataclasses.replace(limits.bounds, prompts=limits.max_fanout))
    return app


def run_server(
    engine: EngineOrFactory,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    metrics: ServerMetrics | None = None,
    log_level: str = "info",
    access_log: bool = True,
    metrics_prefix: str = DEFAULT_PREFIX,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    root_path: str = "",
    uds: str | None = None,
    **app_options: Any,
) -> int:
    """Serves until interrupted; the server owns the engine and shuts it down on exit.  `app_options`: build_app's
    api_key / CORS keywords.  SIGTERM / SIGINT drain with a deadline of `shutdown_timeout` seconds (shutdown.py).
    `root_path` (--root-path): the path prefix a reverse proxy strips before forwarding; `uds` (--uds): listen on
    this Unix domain socket instead of host:port.  Returns the exit code: 1 when the engine died for good
    (--no-engine-restart), else 0."""
    # A hostile request's buffers (a 7 MB prompt's encoding, its JSON) go back to the system once freed.
    return_large_frees_to_the_os()
    app = build_app(engine, metrics=metrics, owns_engine=True, metrics_prefix=metrics_prefix, **app_options)
    config = graceful_config(app, host, port, shutdown_timeout, log_level=log_level, access_log=access_log,
                             root_path=root_path, uds=uds)

    def kill_engines() -> None:
        server_state = getattr(app.state, "server", None)
        kill = getattr(server_state.engine, "kill", None) if server_state is not None else None
        if kill is not None:
            kill()

    server = DrainingServer(config, app.state.drain, shutdown_timeout, kill_engines)
    app.state.on_fatal = server.fail
    if uds:
        logger.info("serving on unix:%s (/v1)", uds)
    else:
        logger.info("serving on http://%s:%d%s/v1", host, port, root_path)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled once it has shut down: not an error here
        return server.exit_code or 128 + signal.SIGINT
    return server.exit_code


class BackgroundServer:
    """uvicorn in a daemon thread on a free port (port=0): for tests and benchmarks."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    access_log=False))
        self.host = host
        self.port = port
        self._thread = threading.Thread(target=self.server.run, name="tokenspout-http", daemon=True)

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        end = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
