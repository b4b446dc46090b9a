"""Replicas of the OpenAI server on Ray Serve, across machines (README, Scaling out: Many machines).

    serve run tokenspout.entrypoints.ray_serve:app num_replicas=2 num_threads=1     # any `tokenspout serve` flag
    tokenspout serve --ray --num-replicas 2                                        # the same, from our CLI

Two deployments:
- `TokenspoutReplica` (N replicas, 1 CPU and 1 engine thread each by default): each owns one engine (AsyncLLM, its
  own engine-core process, model copy, KV and prefix cache) and the unchanged FastAPI app of build_app, which it
  runs in-process for every request the ingress forwards (ray_asgi.py): same routes, same 400s, same SSE.
- `TokenspoutIngress` (0 CPU; Ray Serve's HTTP proxy sends every request here): reads the body, computes the
  prompt's affinity key (ray_routing.py) and forwards the request through a DeploymentHandle whose request router
  (`PrefixAffinityRouter`, Ray Serve's custom request router API) picks the replica by prefix affinity + load.
  The body must be read before routing: Ray Serve's proxy routes before the body arrives, so a router on the
  replicas themselves could not see the prompt.
Failure: a replica that dies (actor killed, machine lost) fails its in-flight requests (500 before the response
started, else an error frame + [DONE] in the stream); Ray Serve's controller starts a new one; the others keep serving.
A replica whose engine process dies fails its health check, so Serve replaces it too.

Ray is imported here at module level: this module is only imported in Ray mode (the plain server never imports it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any, cast

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Deployment
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tokenspout.entrypoints.ray_asgi import ForwardedRequest, Head, run_asgi
from tokenspout.entrypoints.ray_routing import AFFINITY_SLACK, AffinityRule, affinity_key

logger = logging.getLogger(__name__)

APP_NAME = "tokenspout"
REPLICA_HEADER = b"x-tokenspout-replica"  # which replica answered (debugging, tests)
_SSE = b"text/event-stream"
# Serve's proxy adds its own x-request-id (the id it passed in, which the app echoes): keep one.
_PROXY_SETS = {b"x-request-id"}


class PrefixAffinityRouter(RequestRouter):
    """ray_routing.AffinityRule on Ray Serve's per-replica ongoing-request counts (its queue-length cache, probed
    when stale).  Runs inside the ingress, in the handle to the replicas; state is per ingress replica."""

    def initialize_state(self, **kwargs: Any) -> None:
        """kwargs: RequestRouterConfig.request_router_kwargs (`slack`, the rule's)."""
        self.rule: AffinityRule[ReplicaID] = AffinityRule(slack=kwargs.get("slack", AFFINITY_SLACK))

    @staticmethod
    def _key(pending_request: PendingRequest | None) -> str | None:
        args = pending_request.args if pending_request is not None else ()
        return args[0].affinity_key if args and isinstance(args[0], ForwardedRequest) else None

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Back off between rounds when every replica is full (Serve retries at once otherwise: a hot loop).
            pending_request.routing_context.should_backoff = True
        loads: dict[ReplicaID, int] = {}
        stale: list[RunningReplica] = []
        for r in candidate_replicas:
            n = self.replica_queue_len_cache.get(r.replica_id)
            (stale.append(r) if n is None else loads.__setitem__(r.replica_id, n))
        if stale:
            for r, n in await self._probe_queue_lens(stale, 0):
                if n is not None:  # no answer in time: not a candidate this round
                    loads[r.replica_id] = n
        if not loads:
            return [candidate_replicas]
        replicas = self.curr_replicas
        # One rank each: the pick first; if it refuses (max_ongoing_requests reached), the next least loaded.
        return [[replicas[rid]] for rid in self.rule.ranked(self._key(pending_request), loads) if rid in replicas]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.rule.record(self._key(pending_request), replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.rule.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self.curr_replicas)
        super().update_replicas(replicas)
        for gone in before - set(self.curr_replicas):
            self.rule.forget(gone)


@serve.deployment(name="TokenspoutReplica")
class TokenspoutReplica:
    """One engine + the OpenAI app; requests arrive as ForwardedRequest from the ingress."""

    def __init__(self, model: str | None, engine_kwargs: dict[str, Any], app_options: dict[str, Any]) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import torch

        from tokenspout.engine.async_llm import AsyncLLM
        from tokenspout.engine.llm import build_engine_config
        from tokenspout.entrypoints.openai.api_server import build_app

        torch.set_num_threads(1)  # this process only detokenizes; the engine process has the replica's threads
        self.engine = AsyncLLM(build_engine_config(model, **engine_kwargs))
        self.app = build_app(self.engine, owns_engine=False, **app_options)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        logger.info("replica %s serving %s", self.replica_id, self.engine.model_name)

    async def forward(self, req: ForwardedRequest) -> AsyncIterator[Head | bytes]:
        async for item in run_asgi(self.app, req, [(REPLICA_HEADER, self.replica_id.encode())]):
            yield item

    def check_health(self) -> None:
        """Serve's periodic health check: a dead engine process makes the replica unhealthy, so Serve replaces it."""
        if self.engine.errored:
            raise RuntimeError(f"engine is dead: {self.engine.dead_reason}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _error_body(message: str, status: int) -> bytes:
    err_type = "ServiceUnavailableError" if status == 503 else "InternalServerError"
    return json.dumps({"error": {"message": message, "type": err_type, "param": None, "code": status}}).encode()


@serve.deployment(name="TokenspoutIngress", ray_actor_options={"num_cpus": 0})
class TokenspoutIngress:
    """Ray Serve's HTTP proxy sends every request here; it forwards each to the replica the router picks."""

    def __init__(self, replicas: DeploymentHandle) -> None:
        self.replicas = replicas.options(stream=True)

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        client = request.client
        fwd = ForwardedRequest(
            method=request.method, path=request.url.path, query_string=request.scope.get("query_string", b""),
            headers=list(request.scope["headers"]), body=body,
            affinity_key=affinity_key(body) if request.method == "POST" and body else None,
            client=(client.host, client.port) if client else None)
        # a handle with stream=True: the call is a generator of the replica's items
        stream = cast(DeploymentResponseGenerator, self.replicas.forward.remote(fwd))
        try:
            status, app_headers = await stream.__anext__()
        except Exception as e:  # noqa: BLE001 - the replica died or refused: an OpenAI-shaped 500, never a hang
            logger.warning("replica failed before answering %s %s: %s", fwd.method, fwd.path, e)
            return Response(_error_body(f"replica failed: {type(e).__name__}", 500), 500,
                            media_type="application/json")
        headers = [(k, v) for k, v in app_headers if k.lower() not in _PROXY_SETS]
        content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
        if content_type.startswith(_SSE):
            response: Response = StreamingResponse(self._relay(stream), status_code=status)
            response.raw_headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
            return response
        try:  # a JSON answer is small: buffered, so a replica lost midway is a clean 500, not a cut body
            content = b"".join([chunk async for chunk in stream])
        except Exception as e:  # noqa: BLE001
            logger.warning("replica failed while answering %s %s: %s", fwd.method, fwd.path, e)
            return Response(_error_body(f"replica failed: {type(e).__name__}", 500), 500,
                            media_type="application/json")
        response = Response(content, status_code=status)
        response.raw_headers = list(headers)
        return response

    async def _relay(self, stream: Any) -> AsyncIterator[bytes]:
        finished = False
        try:
            async for chunk in stream:
                yield chunk
            finished = True
        except Exception as e:  # noqa: BLE001 - the stream's end as OpenAI's clients understand an error (sse.py)
            logger.warning("replica failed mid-stream: %s", e)
            finished = True
            yield b"data: " + _error_body(f"replica failed mid-stream: {type(e).__name__}", 500) + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away: stop the replica's request (it aborts it in the engine)
                stream.cancel()


# ---- building the application -------------------------------------------------------------------------------
def scaling_options(args: argparse.Namespace) -> dict[str, Any]:
    """num_replicas, or Ray Serve's autoscaling_config when any of --min/--max-replicas is given."""
    if args.min_replicas is None and args.max_replicas is None:
        return {"num_replicas": args.num_replicas}
    low = args.min_replicas if args.min_replicas is not None else 1
    high = args.max_replicas if args.max_replicas is not None else max(low, args.num_replicas)
    if not 0 <= low <= high or high < 1:
        raise ValueError(f"--min-replicas {low} / --max-replicas {high}: need 0 <= min <= max, max >= 1")
    return {"autoscaling_config": {"min_replicas": low, "max_replicas": high,
                                   "initial_replicas": min(max(args.num_replicas, low), high),
                                   "target_ongoing_requests": args.target_ongoing_requests}}


def build_application(args: argparse.Namespace) -> Any:
    """The Serve application for parsed `tokenspout serve --ray ...` flags."""
    from tokenspout.entrypoints.cli import engine_kwargs
    from tokenspout.entrypoints.cli_args import server_app_options

    if args.data_parallel_size != 1:
        raise ValueError("--data-parallel-size is one machine's layout; with --ray use --num-replicas")
    kwargs = engine_kwargs(args)
    kwargs["num_threads"] = kwargs["num_threads"] or 1  # a replica is 1 CPU, 1 engine thread unless told
    cpus = args.replica_cpus if args.replica_cpus is not None else kwargs["num_threads"]
    app_options = {**server_app_options(args), "metrics_prefix": args.metrics_prefix}
    # serve.deployment turns each class into a Deployment (its stubs keep the class type: hence the casts), and
    # RequestRouterConfig takes the router class itself (its field is typed as the import path / dict form).
    router = RequestRouterConfig(request_router_class=PrefixAffinityRouter)  # type: ignore[arg-type]
    replica = cast(Deployment, TokenspoutReplica).options(
        ray_actor_options={"num_cpus": cpus}, max_ongoing_requests=args.max_ongoing_requests,
        request_router_config=router, health_check_period_s=5, **scaling_options(args))
    ingress = cast(Deployment, TokenspoutIngress).options(num_replicas=args.ingress_replicas,
                                                          max_ongoing_requests=args.max_ongoing_requests * 64)
    return ingress.bind(replica.bind(args.model, kwargs, app_options))


def _argv(builder_args: dict[str, Any]) -> list[str]:
    """`serve run ...:app key=value` arguments as `tokenspout serve` flags: true/false are on/off switches."""
    argv: list[str] = []
    for key, value in builder_args.items():
        flag = "--" + key.replace("_", "-")
        text = str(value)
        if text.lower() == "true":
            argv.append(flag)
        elif text.lower() == "false":
            argv.append("--no-" + flag[2:])
        else:
            argv += [flag, text]
    return argv


def app(args: dict[str, str]) -> Any:
    """Ray Serve application builder: `serve run tokenspout.entrypoints.ray_serve:app num_replicas=2 ...`."""
    from tokenspout.entrypoints.cli import build_parser
    from tokenspout.entrypoints.cli_args import parse_cli

    return build_application(parse_cli(*build_parser(), ["serve", "--ray", *_argv(args)]))


def run_on_ray(args: argparse.Namespace) -> None:
    """`tokenspout serve --ray`: deploys the application on the cluster (joined, or started here when there is
    none), Serve's HTTP proxy on --host/--port, until SIGINT/SIGTERM; then deletes the application (a cluster this
    process started goes down with it, Serve included; a joined cluster keeps running)."""
    import signal
    import threading

    import ray

    application = build_application(args)  # bad flags fail here, before any cluster starts
    ray.init(address=args.ray_address, logging_level=logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(application, name=APP_NAME, route_prefix="/")
        logger.info("serving on http://%s:%d/v1 through Ray Serve (%s)", args.host, args.port, scaling_options(args))
        stop.wait()
    finally:
        try:
            serve.delete(APP_NAME)
        finally:
            ray.shutdown()
