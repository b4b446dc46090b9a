"""`vllm serve` parity for the command line: the model as a positional argument, the server's auth / CORS flags,
and unknown flags answered with the closest known one (no silent prefix matching)."""

from __future__ import annotations

import argparse
import difflib
import json
import os
from collections.abc import Sequence
from typing import Any

API_KEY_ENV = "TOKENSPOUT_API_KEY"


class SuggestingArgumentParser(argparse.ArgumentParser):
    """allow_abbrev off (a prefix such as --max-model is an unknown flag, not --max-model-len), and every parser
    made from it (subcommands) is one too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def known_flags(self) -> list[str]:
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]

    def unknown_flag_message(self, arg: str) -> str:
        flag = arg.split("=", 1)[0]
        close = difflib.get_close_matches(flag, self.known_flags(), n=1, cutoff=0.6)
        return f"unknown flag {flag}" + (f"; did you mean {close[0]}?" if close else "")


def _json_list(value: str) -> list[str]:
    """--allowed-origins '["https://a.example", "https://b.example"]' (vLLM's JSON form); a bare value is a list
    of one."""
    if not value.lstrip().startswith("["):
        return [value]
    try:
        items = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise argparse.ArgumentTypeError("expected a JSON list of strings, e.g. '[\"*\"]'")
    return items


def add_chat_template_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file, or the template text itself; replaces the model's template "
                        "for chat requests and /tokenize messages")


def add_server_args(p: argparse.ArgumentParser) -> None:
    """`serve`'s model positional and its HTTP flags (names and forms as vLLM's)."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model folder (as `vllm serve MODEL`); same as --model")
    p.add_argument("--api-key", nargs="+", action="extend", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (any one of the keys) on every route except /health, "
                        f"/metrics, /version and the docs; default: ${API_KEY_ENV}")
    p.add_argument("--allowed-origins", type=_json_list, default=None,
                   help="CORS: JSON list of allowed origins, e.g. '[\"*\"]' (default: no CORS headers)")
    p.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS: JSON list (default: [\"*\"])")
    p.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS: JSON list (default: [\"*\"])")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, auth)")
    from tokenspout.reasoning import REASONING_PARSERS
    from tokenspout.tool_parsers import TOOL_PARSERS

    p.add_argument("--tool-call-parser", choices=["auto", *TOOL_PARSERS], default="auto",
                   help="how the model writes tool calls; auto: by the chat template's text (README, Tool calling)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility: tool_choice 'auto' is always on when a parser is known")
    p.add_argument("--no-playground", action="store_true",
                   help="do not serve the playground page at / and /playground (README, Playground)")
    p.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=None,
                   help="split <think> reasoning into message.reasoning_content (README, Reasoning)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a request's own Jinja chat template (chat_template, or inside chat_template_kwargs), "
                        "rendered in a sandbox under a 5 s limit; without this flag such a request is a 400")
    from tokenspout.entrypoints.openai import limits

    p.add_argument("--max-request-body-bytes", type=int, default=limits.DEFAULT_MAX_BODY_BYTES,
                   help="a larger request body is a 413, refused before it is parsed (default: 8 MiB)")
    p.add_argument("--max-request-header-bytes", type=int, default=limits.DEFAULT_MAX_HEADER_BYTES,
                   help="request headers larger than this together (names + values) are a 431 (default: 32 KiB)")
    from tokenspout.entrypoints.openai.protocol.bounds import FLAGS, RequestBounds

    defaults = RequestBounds()
    what = {"json_depth": "levels of JSON nesting anywhere in a request body",
            "json_containers": "JSON objects and lists in a request body, all together", "stop": "stop strings",
            "token_list": "entries of stop_token_ids, bad_words, logit_bias, guided_choice / structured choices",
            "allowed_token_ids": "allowed_token_ids entries", "messages": "chat messages (also on /tokenize)",
            "tools": "tools"}
    for bound, flag in FLAGS.items():
        p.add_argument(flag, type=int, default=getattr(defaults, bound), metavar="N",
                       help=f"at most N {what[bound]} per request, else a 400 (default: {getattr(defaults, bound)})")
    p.add_argument("--max-request-fanout", type=int, default=limits.DEFAULT_MAX_FANOUT,
                   help="at most this many completions (prompts x n) per request, else a 400 (default: 256)")
    p.add_argument("--max-queued-requests", type=int, default=limits.DEFAULT_MAX_QUEUED_REQUESTS,
                   help="requests (each prompt x n counted) that may wait beyond the --max-num-seqs the engines "
                        "run; past it a new request is a 503 with Retry-After (default: 1024; negative: no limit)")


    from tokenspout.entrypoints.openai import responses_store

    p.add_argument("--max-stored-responses", type=int, default=responses_store.DEFAULT_MAX_STORED_RESPONSES,
                   help="/v1/responses with store: at most this many responses kept in memory, the least recently "
                        "used evicted first (default: 1024; 0: none stored)")
    p.add_argument("--max-stored-response-bytes", type=int, default=responses_store.DEFAULT_MAX_STORED_BYTES,
                   help="... and at most this many bytes of them (default: 64 MiB)")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="as vLLM: every stream ends with a usage chunk, as if stream_options.include_usage")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="as vLLM: logprob tokens are 'token_id:N' unless a request says otherwise")
    p.add_argument("--root-path", default="",
                   help="as vLLM: the path prefix a reverse proxy strips before forwarding (FastAPI's root_path)")
    p.add_argument("--uds", default=None, metavar="PATH",
                   help="as vLLM: listen on this Unix domain socket instead of --host / --port")


def resolve_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`serve MODEL` and `--model MODEL` are one setting; two different values are an error (exit 2)."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        parser.error(f"the model is given twice with different values: {tag!r} and --model {args.model!r}")
    args.model = tag


def server_app_options(args: argparse.Namespace, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """build_app's keywords from the flags; the flag wins over $TOKENSPOUT_API_KEY."""
    env = os.environ if environ is None else environ
    keys = args.api_key if args.api_key else ([env[API_KEY_ENV]] if env.get(API_KEY_ENV) else None)
    return {"api_key": keys, "allowed_origins": args.allowed_origins, "allowed_methods": args.allowed_methods,
            "allowed_headers": args.allowed_headers, "allow_credentials": args.allow_credentials,
            "tool_call_parser": args.tool_call_parser, "reasoning_parser": args.reasoning_parser,
            "playground": not args.no_playground, "limits": server_limits(args),
            "trust_request_chat_template": args.trust_request_chat_template,
            "max_stored_responses": args.max_stored_responses,
            "max_stored_response_bytes": args.max_stored_response_bytes,
            "force_include_usage": args.enable_force_include_usage,
            "return_tokens_as_token_ids": args.return_tokens_as_token_ids}


def server_limits(args: argparse.Namespace) -> Any:
    """limits.ServerLimits from the flags; the engines run --max-num-seqs each."""
    from tokenspout.entrypoints.openai.limits import ServerLimits

    from tokenspout.entrypoints.openai.protocol.bounds import FLAGS, RequestBounds

    bounds = RequestBounds(**{b: getattr(args, f.removeprefix("--").replace("-", "_")) for b, f in FLAGS.items()})
    return ServerLimits(max_body_bytes=args.max_request_body_bytes, max_fanout=args.max_request_fanout,
                        max_header_bytes=args.max_request_header_bytes, bounds=bounds,
                        max_queued_requests=None if args.max_queued_requests < 0 else args.max_queued_requests,
                        running_capacity=args.max_num_seqs * args.data_parallel_size)


def parse_cli(parser: argparse.ArgumentParser, commands: dict[str, argparse.ArgumentParser],
              argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args, but an unknown flag is named with the closest known flag of its subcommand (exit 2)."""
    args, extras = parser.parse_known_args(argv)
    sub = commands.get(getattr(args, "command", None) or "", parser)
    if extras:
        flag = next((e for e in extras if e.startswith("-")), None)
        if flag is not None and isinstance(sub, SuggestingArgumentParser):
            sub.error(sub.unknown_flag_message(flag))
        sub.error(f"unrecognized arguments: {' '.join(extras)}")
    resolve_model(sub, args)
    return args


def add_ray_args(p: argparse.ArgumentParser) -> None:
    """`serve --ray`: replicas on Ray Serve (README, Scaling out: Many machines); every other serve flag applies to
    each replica."""
    g = p.add_argument_group("Ray Serve (with --ray)")
    g.add_argument("--ray", action="store_true",
                   help="serve replicas on a Ray cluster through Ray Serve's HTTP proxy (needs requirements-ray.txt)")
    g.add_argument("--ray-address", default=None,
                   help="the cluster to join (default: $RAY_ADDRESS, else a cluster started on this machine with "
                        "`ray start`, else a new local one)")
    g.add_argument("--num-replicas", type=int, default=1, help="replicas (engines), one engine each")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling: at least this many replicas")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscaling: at most this many replicas")
    g.add_argument("--target-ongoing-requests", type=float, default=16,
                   help="autoscaling: ongoing requests per replica Ray Serve aims at (default 16)")
    g.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs Ray reserves per replica (default: --num-threads, which defaults to 1 with --ray)")
    g.add_argument("--max-ongoing-requests", type=int, default=256,
                   help="requests in flight per replica before Ray Serve queues more in front of it (default 256)")
    g.add_argument("--ingress-replicas", type=int, default=1,
                   help="replicas of the routing ingress (0 CPU each; routing state is per ingress replica)")
