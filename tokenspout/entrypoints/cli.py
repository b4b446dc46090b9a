"""`tokenspout serve | generate` command line."""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
from pathlib import Path

from tokenspout.config import ACTIVATION_QUANTS, CACHE_DEFAULTS, SCHEDULER_DEFAULTS
from tokenspout.entrypoints.cli_args import (
    SuggestingArgumentParser,
    add_chat_template_arg,
    add_ray_args,
    add_server_args,
    parse_cli,
    server_app_options,
)
from tokenspout.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--tokenizer", default=None,
                   help="a folder whose tokenizer (and chat template) replaces the model's, e.g. for a GGUF file")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: float32 where the C kernels run (the fastest path: bench.paths), else bfloat16 where the "
                        "CPU has native bf16 matrix instructions, else float32")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4", "bf16", "fp16"],
                   help="weight format.  int8 / int4: weight-only, groups of 32 (int8 = Q8_0, int4 = Q4_1 layers + "
                        "int8 LM head): 3.5-5x fewer weight bytes per decode step; bf16 / fp16: 16-bit float weights "
                        "(half of float32's bytes) through the same kernels.  auto: int4 for the default model (whose "
                        "GGUF weights are exactly Q4_1 / Q8_0, so it is lossless there), the checkpoint's own 16-bit "
                        "type for a bf16 / fp16 folder (lossless), none (float32) for a float32 folder")
    p.add_argument("--activation-quant", default="int16", choices=list(ACTIVATION_QUANTS),
                   help="how int4 / int8 layers round their inputs for the integer dot products.  int16 (default): "
                        "float32-level results.  int8: llama.cpp's numerics; prompts and batches of 16+ sequences "
                        "multiply int4 weights ~1.5-1.8x faster on AVX2, at ~1 logit of error on the default model "
                        "(greedy near-ties can flip).  No effect on float weights or without the C kernels")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a request's tokens and logprobs do not depend on the other requests it shares steps with "
                        "(vLLM's batch-invariant mode): every step runs the C kernels' batch-invariant build.  Needs "
                        "the kernels (AVX2) and --activation-quant int16; ~10-20%% slower linear layers at 2-15 "
                        "sequences a step, the same speed at 1 and at 16+")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=float, default=CACHE_DEFAULTS.kv_cache_memory_gib,
                   help="GiB for the paged KV cache")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float16", "model"],
                   help="auto: float16 for a float32 model (llama.cpp's default cache type: half the bytes, twice the "
                        "tokens per budget, and decode attention at large batches is bound by reading them: +25%% "
                        "tok/s at 64 clients), the model's own dtype for a bfloat16 one; model: the model's dtype "
                        "(a float32 cache, exact like transformers); float16: always float16")
    p.add_argument("--block-size", type=int, default=CACHE_DEFAULTS.block_size,
                   help="tokens per KV block, the prefix cache's unit")
    p.add_argument("--max-num-seqs", type=int, default=SCHEDULER_DEFAULTS.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=SCHEDULER_DEFAULTS.max_num_batched_tokens)
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads per engine process (default: the cores, divided among the engines)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine-core processes behind the server, each with its own KV cache (README, Scaling out)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                   help="schedule and prepare step N+1 while step N runs (see README: on this 2-core CPU the "
                        "overlap takes a core from the model)")
    p.add_argument("--speculative", default=None, choices=["ngram", "draft"], help="speculative decoding proposer")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--ngram-min", type=int, default=2)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share KV blocks of common prefixes between requests (--no-enable-prefix-caching: off)")
    p.add_argument("--draft-model", default=None,
                   help="--speculative draft: a smaller local model folder with the target's tokenizer")
    p.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                   help="auto: the model's generation_config.json sampling values (temperature, top_p, top_k, min_p, "
                        "repetition_penalty) are the defaults of requests that omit them; vllm: neutral defaults")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="--speculative draft: self-draft from the target's first L layers + its head")
    p.add_argument("--engine-hang-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="an engine process silent this long (it sends a heartbeat every second, also during long "
                        "steps) is hung: /health answers 503, it is killed and handled as dead")
    p.add_argument("--engine-restart", action=argparse.BooleanOptionalAction, default=True,
                   help="restart a dead or hung engine process (in-flight requests end with an error, new ones get "
                        "503 until it is back); --no-engine-restart: the server exits non-zero instead, as vLLM")
    add_chat_template_arg(p)


def resolve_quantization(flag: str, model: str | None) -> str | None:
    """auto: int4 for the default model (its GGUF's Q4_1 / Q8_0 weights, exactly); for a GGUF file the format of
    its layers (4-bit types -> int4, other quantized types -> int8, float -> none); for a model folder its weights'
    own type (bf16 / fp16 folders keep 16-bit weights, float32 ones float32): lossless either way."""
    if flag == "auto":
        from tokenspout.models.gguf_file import default_quantization, is_gguf

        if model is not None and is_gguf(Path(model)):
            return default_quantization(Path(model).expanduser())
        if model is None:
            return "int4"
        from tokenspout.models.checkpoint import checkpoint_dtype

        return {"BF16": "bf16", "F16": "fp16"}.get(checkpoint_dtype(Path(model).expanduser()) or "")
    return None if flag == "none" else flag


def resolve_kv_cache_dtype(flag: str, dtype: str) -> str:
    """The engine's kv_cache_dtype ("auto" there is the model's dtype).  The server's auto is float16 for a float32
    model: a float16 cache is what llama.cpp serves by default, and at 64 clients the C kernels' decode attention
    reads the cache at memory speed, so half the bytes made the step 1.25x faster (bench/results/kv_dtype.json);
    a bfloat16 model keeps its own 16-bit dtype."""
    if flag == "model":
        return "auto"
    if flag == "auto":
        import torch

        from tokenspout.models.loader import resolve_dtype

        return "float16" if resolve_dtype(dtype) == torch.float32 else "auto"
    return flag


def engine_kwargs(args: argparse.Namespace) -> dict:
    # "none" stays "none": build_engine_config reads a bare None as a GGUF file's own format
    quant = "none" if args.quantization == "none" else resolve_quantization(args.quantization, args.model)
    return {"dtype": args.dtype, "quantization": quant,
            "max_model_len": args.max_model_len, "kv_cache_memory": args.kv_cache_memory,
            "kv_cache_dtype": resolve_kv_cache_dtype(args.kv_cache_dtype, args.dtype),
            "block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "served_model_name": args.served_model_name,
            "num_threads": args.num_threads, "speculative": args.speculative,
            "num_speculative_tokens": args.num_speculative_tokens, "ngram_min": args.ngram_min,
            "ngram_max": args.ngram_max, "enable_prefix_caching": args.enable_prefix_caching,
            "draft_model": args.draft_model, "draft_layers": args.draft_layers,
            "async_scheduling": args.async_scheduling, "generation_config": args.generation_config,
            "chat_template": args.chat_template, "data_parallel_size": args.data_parallel_size,
            "tokenizer": args.tokenizer, "engine_hang_timeout": args.engine_hang_timeout,
            "engine_restart": args.engine_restart, "activation_quant": args.activation_quant,
            "batch_invariant": args.batch_invariant}


class Spinner:
    """A one-line spinner on stderr while the model converts or loads."""

    def __init__(self, label: str):
        self.label = label
        self.frames = itertools.cycle("|/-\\")
        self.tty = sys.stderr.isatty()

    def __call__(self) -> None:
        if self.tty:
            sys.stderr.write(f"\r{next(self.frames)} {self.label}")
            sys.stderr.flush()

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\r" + " " * (len(self.label) + 2) + "\r")
            sys.stderr.flush()


def cmd_generate(args: argparse.Namespace) -> int:
    from tokenspout.engine.llm import LLM

    spinner = Spinner("loading the model (the default model is converted once on first use)...")
    spinner()
    llm = LLM(args.model, on_wait=spinner, **engine_kwargs(args))
    spinner.done()
    try:
        prompt = args.prompt
        if not args.raw:
            prompt = llm.processor.apply_chat_template([{"role": "user", "content": prompt}])
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        for text in llm.stream(prompt, params):
            sys.stdout.write(text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        llm.shutdown()
    return 0


def _port(value: str) -> int:
    """0..65535 (0: any free port); 70000 had listened on 70000 - 65536 (the port wraps)."""
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port must be in [0, 65535], got {port}")
    return port


def _seconds(value: str) -> float:
    """A finite duration of 0 to 86400 s (inf / nan had failed only at shutdown)."""
    s = float(value)
    if not 0 <= s <= 86400:  # (False for NaN)
        raise argparse.ArgumentTypeError(f"must be 0 to 86400 seconds, got {value}")
    return s


def _metrics_prefix(value: str) -> str:
    from tokenspout.metrics import check_prefix

    try:
        return check_prefix(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_serve(args: argparse.Namespace) -> int:
    if args.ray:
        from tokenspout.entrypoints.ray_serve import run_on_ray  # imports ray: only here

        run_on_ray(args)
        return 0
    from tokenspout.engine.async_llm import make_async_client
    from tokenspout.engine.llm import build_engine_config

    options = server_app_options(args)  # the server's own limits checked before any model loads
    config = build_engine_config(args.model, **engine_kwargs(args))  # converts the default model once, here
    # Start the engine process now: it loads the model while this process imports the web stack and loads the
    # tokenizer.  The server's lifespan waits for it: uvicorn accepts connections once the engine is ready.
    client = make_async_client(config)
    try:
        from tokenspout.engine.async_llm import AsyncLLM
        from tokenspout.entrypoints.openai.api_server import run_server

        return run_server(lambda: AsyncLLM(config, client=client), host=args.host, port=args.port,
                          metrics_prefix=args.metrics_prefix, shutdown_timeout=args.shutdown_timeout,
                          root_path=args.root_path, uds=args.uds, **options)
    finally:
        client.shutdown()  # a no-op when the server has shut the engine down


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser and its subcommands' parsers (by name)."""
    parser = SuggestingArgumentParser(prog="tokenspout")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=8000)
    add_server_args(s)
    s.add_argument("--shutdown-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                   help="on SIGTERM / SIGINT, in-flight requests may finish for this long; then open streams end with "
                        "an error frame and [DONE]; a second signal exits at once")
    s.add_argument("--metrics-prefix", type=_metrics_prefix, default="tokenspout",
                   help="prefix of the /metrics families (vllm: vLLM's names, for its Grafana dashboards)")
    add_ray_args(s)
    s.set_defaults(func=cmd_serve)
    g = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    add_engine_args(g)
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="send the prompt as is (no chat template)")
    g.set_defaults(func=cmd_generate)
    return parser, {"serve": s, "generate": g}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_cli(*build_parser(), argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        logging.getLogger("tokenspout").error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
