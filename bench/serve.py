"""Load generator for any OpenAI-compatible server: closed-loop, streamed chat completions.

    python -m bench.serve --base-url http://127.0.0.1:8000/v1 --model NAME --concurrency 1 16 64 \
        --mode greedy random --max-tokens 128 --num-requests 64 --label tokenspout \
        --out bench/results/serve_tokenspout.json

Per (mode, concurrency) level, `concurrency` workers each send their next request as soon as the previous one
finished, until `num-requests` requests are done.  Every request streams with `ignore_eos: true` so each returns
exactly max_tokens tokens on servers that honour it.  Reported per level:
- output tok/s: tokens received / wall time of the level (tokens from the usage chunk of
  stream_options.include_usage; content chunks are counted when a server sends no usage),
- TTFT p50/p99: request sent → first non-empty content chunk,
- ITL p50/p99: gaps between consecutive content chunks,
- errors: non-200 answers, error frames and transport failures.
`--context N` puts a document of about N tokens before each question (a long chat or an agent's context; each
request's own, so no server reuses another's prompt cache): the ITL then is decoding at that depth, the TTFT the
whole prompt's processing, and `prompt_tokens_p50` says how long the prompts were (from the usage chunk).
Sampling: greedy = temperature 0; random = temperature 0.8, top_p 0.95, top_k 50.  Both send `min_p: 0`, and
`--extra-body '{"repeat_penalty": 1}'` (what bench.compare passes to llama.cpp's server, whose defaults differ)
adds fields to every request; tokenspout answers 400 to fields it does not know, so they are not sent to it.

The client shares the machine with the server it measures, so it is lean: one plain HTTP/1.1 connection per
request over asyncio, the response parsed by httptools (uvicorn's C parser), SSE lines split by hand.  httpx's
streaming cost ~200 us of CPU per streamed chunk (3.3 s of CPU in a 37 s c=64 level on 2 cores: time taken from
the server under test); this costs a fraction of that (see README, Benchmarks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httptools

PROMPTS = [
    "Explain how a bicycle stays upright while moving.",
    "Write a short poem about the first snow of winter.",
    "What are the main differences between TCP and UDP?",
    "Give me three tips for learning a new language as an adult.",
    "Describe the water cycle to a ten-year-old.",
    "Summarize the plot of a heist movie you invent on the spot.",
    "How does a refrigerator keep food cold?",
    "List five creative uses for an empty glass jar.",
    "Why is the sky blue during the day and red at sunset?",
    "Write a polite email declining a meeting invitation.",
    "What is the Pythagorean theorem and where is it used?",
    "Describe a bustling market in a fictional desert city.",
    "How do vaccines train the immune system?",
    "Suggest a weekly workout plan for a beginner.",
    "Explain recursion with a simple example in Python.",
    "What causes the seasons on Earth?",
    "Tell a short story about a robot who learns to paint.",
    "Compare electric cars and petrol cars in a few sentences.",
    "How do bees communicate the location of flowers?",
    "Give a recipe for a simple vegetable soup.",
    "What is inflation and why does it matter?",
    "Describe the sound of rain on a tin roof.",
    "Explain what a hash table is and why lookups are fast.",
    "Write a limerick about a forgetful cat.",
    "What should I pack for a three-day hiking trip?",
    "How does the stock market work, in simple terms?",
    "Explain photosynthesis step by step.",
    "Invent a new board game and explain its rules.",
    "Why do we dream? Summarize the main theories.",
    "Write a product description for a solar-powered lamp.",
    "What are black holes and how do they form?",
    "Give advice to someone starting their first job.",
    "How do airplanes generate lift?",
    "Describe your ideal city park.",
    "Explain the difference between weather and climate.",
    "Write a dialogue between a teacher and a curious student.",
    "What is machine learning, explained without jargon?",
    "How can I improve my sleep habits?",
    "Describe the life cycle of a butterfly.",
    "Write a haiku sequence about the ocean.",
    "What were the causes of the Industrial Revolution?",
    "Explain how a compiler turns code into a program.",
    "Give me a packing list for moving to a new apartment.",
    "How do volcanoes erupt?",
    "Write a motivational speech for a sports team at half time.",
    "What is the role of the mitochondria in a cell?",
    "Describe a sunrise seen from a mountain top.",
    "Explain the rules of chess briefly.",
    "How does GPS determine your location?",
    "Write a short fable with a moral about patience.",
    "What are the benefits of reading fiction?",
    "Explain what an API is to a non-programmer.",
    "How do tides work?",
    "Plan a one-day itinerary for visiting a historic town.",
    "Describe how bread rises.",
    "What is the difference between a virus and a bacterium?",
    "Write a letter from a lighthouse keeper to a friend.",
    "Explain supply and demand with an example.",
    "How do noise-cancelling headphones work?",
    "Give tips for keeping houseplants alive.",
    "What makes a good password, and why?",
    "Describe the northern lights and what causes them.",
    "Write the opening paragraph of a mystery novel.",
    "Explain how the internet routes a message from one computer to another.",
]

MODES: dict[str, dict] = {
    "greedy": {"temperature": 0.0},
    "random": {"temperature": 0.8, "top_p": 0.95, "top_k": 50},
}
_FAIRNESS_EXTRAS = {"min_p": 0.0}


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    tokens: int = 0
    prompt_tokens: int | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Target:
    """Where requests go: host, port, the chat completions path and the extra header lines."""

    host: str
    port: int
    path: str
    headers: bytes
    timeout: float

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Target:
        url = urlsplit(args.base_url.rstrip("/") + "/chat/completions")
        if url.scheme != "http" or url.hostname is None:
            raise SystemExit(f"--base-url must be http://host[:port]/...: {args.base_url}")
        auth = f"Authorization: Bearer {args.api_key}\r\n" if args.api_key else ""
        return cls(url.hostname, url.port or 80, url.path, auth.encode(), args.timeout)


class ServerError(Exception):
    """A non-200 answer, an error frame or a stream cut short."""


class _Response:
    """httptools callbacks: the response body arrives in pieces (chunked transfer decoded by the parser)."""

    def __init__(self) -> None:
        self.body = bytearray()
        self.complete = False

    def on_body(self, data: bytes) -> None:
        self.body += data

    def on_message_complete(self) -> None:
        self.complete = True


class _Stream:
    """Per request: the SSE `data:` payloads seen so far, counted and timed as they arrive."""

    def __init__(self, t0: float) -> None:
        self.res = RequestResult()
        self.t0, self.last, self.chunks, self.usage_tokens, self.done = t0, None, 0, None, False

    def event(self, data: bytes, now: float) -> None:
        if data == b"[DONE]":
            self.done = True
            return
        obj = json.loads(data)
        if obj.get("error"):
            raise ServerError(f"error frame: {obj['error']}")
        if obj.get("usage"):
            self.usage_tokens = obj["usage"].get("completion_tokens")
            self.res.prompt_tokens = obj["usage"].get("prompt_tokens")
        for choice in obj.get("choices") or ():
            if (choice.get("delta") or {}).get("content"):
                if self.last is None:
                    self.res.ttft = now - self.t0
                else:
                    self.res.itls.append(now - self.last)
                self.last, self.chunks = now, self.chunks + 1


async def one_request(target: Target, body: dict) -> RequestResult:
    t0 = time.perf_counter()
    stream = _Stream(t0)
    try:
        async with asyncio.timeout(target.timeout):
            await _exchange(target, body, stream)
    except ServerError as e:
        stream.res.error = str(e)
        return stream.res
    except (OSError, TimeoutError, ValueError, httptools.HttpParserError) as e:  # ValueError: bad JSON
        stream.res.error = f"{type(e).__name__}: {e}"
        return stream.res
    res = stream.res
    res.latency = time.perf_counter() - t0
    res.tokens = stream.usage_tokens if stream.usage_tokens is not None else stream.chunks
    res.ok = True
    return res


async def _exchange(target: Target, body: dict, stream: _Stream) -> None:
    """POSTs body and feeds each SSE data line to stream; ServerError for a non-200 answer or a cut stream."""
    payload = json.dumps(body).encode()
    head = (f"POST {target.path} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n").encode()
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(head + target.headers + b"\r\n" + payload)
        resp = _Response()
        parser = httptools.HttpResponseParser(resp)
        pending = b""
        while not resp.complete:
            data = await reader.read(1 << 16)
            if not data:
                break
            parser.feed_data(data)
            if parser.get_status_code() != 200:
                continue  # read the whole error body
            now = time.perf_counter()
            lines = (pending + bytes(resp.body)).split(b"\n")
            resp.body.clear()
            pending = lines.pop()
            for line in lines:
                if line.startswith(b"data:"):
                    stream.event(line[5:].strip(), now)
                    if stream.done:
                        return
        status = parser.get_status_code()
        if status != 200:
            raise ServerError(f"HTTP {status}: {bytes(resp.body)[:200]!r}")
        if not stream.done:
            raise ServerError("stream ended without [DONE]")
    finally:
        writer.close()


CHARS_PER_TOKEN = 3.55  # the numbered prompts below, default model tokenizer (what --context sizes documents by)


def with_context(prompt: str, index: int, tokens: int) -> str:
    """prompt after a document of about `tokens` tokens: the prompts list from a different starting point for
    each index (so that no two requests share a prefix beyond the chat template), numbered paragraphs."""
    if tokens <= 0:
        return prompt
    parts, n, j = [f"Notes, set {index}:"], 0, 0
    while n < tokens * CHARS_PER_TOKEN:
        parts.append(f"{j + 1}. {PROMPTS[(index * 7 + j) % len(PROMPTS)]}")
        n, j = n + len(parts[-1]) + 1, j + 1
    return "\n".join(parts) + "\n\nWith those notes in mind: " + prompt


def request_body(args: argparse.Namespace, prompt: str, mode: str, max_tokens: int) -> dict:
    return {
        "model": args.model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **MODES[mode],
        **_FAIRNESS_EXTRAS,
        **json.loads(args.extra_body),
    }


async def run_level(target: Target, args: argparse.Namespace, mode: str, concurrency: int, first: int = 0) -> dict:
    """first: the index of the level's first request (--context documents differ across levels too)"""
    total = args.num_requests or max(16, 2 * concurrency)
    next_index = 0
    results: list[RequestResult] = []

    async def worker() -> None:
        nonlocal next_index
        while next_index < total:  # closed loop: the next request leaves when this worker's last one finished
            i = next_index
            next_index += 1
            prompt = with_context(PROMPTS[i % len(PROMPTS)], first + i, args.context)
            body = request_body(args, prompt, mode, args.max_tokens)
            results.append(await one_request(target, body))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    tokens = sum(r.tokens for r in ok)
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    errors = [r.error for r in results if not r.ok]

    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000, 2)

    return {
        "mode": mode,
        "concurrency": concurrency,
        "num_requests": total,
        "completed": len(ok),
        "errors": len(errors),
        "first_errors": errors[:3],
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 2) if wall > 0 else None,
        "ttft_p50_ms": ms(percentile(ttfts, 50)),
        "ttft_p99_ms": ms(percentile(ttfts, 99)),
        "itl_p50_ms": ms(percentile(itls, 50)),
        "itl_p99_ms": ms(percentile(itls, 99)),
        "mean_latency_s": round(sum(r.latency for r in ok) / len(ok), 3) if ok else None,
        "prompt_tokens_p50": percentile(prompt_tokens, 50) if prompt_tokens else None,
    }


def format_table(rows: list[dict]) -> str:
    cols = ["mode", "concurrency", "completed", "errors", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms",
            "itl_p50_ms", "itl_p99_ms"]
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict:
    target = Target.from_args(args)
    warm = await one_request(target, request_body(args, PROMPTS[0], args.mode[0], min(8, args.max_tokens)))
    if not warm.ok:
        raise SystemExit(f"warm-up request failed: {warm.error}")
    rows = []
    for mode in args.mode:
        for c in args.concurrency:
            rows.append(await run_level(target, args, mode, c, first=sum(r["num_requests"] for r in rows)))
            print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    return {
        "label": args.label,
        "base_url": args.base_url,
        "model": args.model,
        "max_tokens": args.max_tokens,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "results": rows,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--mode", nargs="+", choices=sorted(MODES), default=["greedy", "random"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=None, help="per level (default: max(16, 2 x concurrency))")
    p.add_argument("--label", default="server")
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    p.add_argument("--api-key", default=None)
    p.add_argument("--extra-body", default="{}", help="JSON object of fields added to every request body")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--context", type=int, default=0, help="tokens of document before each question (about)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    print(f"{args.label}: {args.base_url} model={args.model} max_tokens={args.max_tokens}", flush=True)
    print(format_table([]), flush=True)
    report = asyncio.run(run(args))
    print("\n" + format_table(report["results"]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
