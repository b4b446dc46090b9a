"""Hostile input against a real `tokenspout serve`: does anything stall the server, and does admission hold?

While one long stream runs and /health is probed every 20 ms, each hostile request below is sent in turn; for each
the table shows its status, its own time, /health's p99 and worst latency and the other stream's worst inter-token
gap while it ran.  Then 5x `--max-queued-requests` concurrent requests: how many were refused (503) and how fast,
whether every admitted one completed, and the server's RSS before / after.  Issue #29's bars: /health p99 < 100 ms,
no gap > 250 ms, refusals within 100 ms, every admitted request completes, RSS bounded.

    .venv/bin/python -m bench.chaos            # writes bench/results/chaos.json
`run(url, ...)` is also what tests/e2e/test_chaos_e2e.py calls (with lenient bounds: CI's cores are shared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx
import psutil

from bench.common import free_port, percentile, write_json

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Hello"}]


def hostile_requests() -> list[tuple[str, str, object]]:
    """(name, path, JSON body or raw bytes): each within what a client can send, each expensive or malformed."""
    big = "lorem ipsum dolor sit amet " * 270_000  # ~7.3 MB: under the 8 MiB body limit
    deep = ('{"model": "%s", "prompt": ' % MODEL + "[" * 100_000 + '"x"' + "]" * 100_000 + "}").encode()
    return [
        ("tokenize 7 MB", "/tokenize", {"prompt": big}),
        ("completion 7 MB prompt", "/v1/completions", {"model": MODEL, "prompt": big, "max_tokens": 1}),
        ("guided_choice 1024 x 1 KB", "/v1/chat/completions",
         {"model": MODEL, "messages": CHAT, "max_tokens": 2, "guided_choice": [f"{i} " + "y" * 1000
                                                                             for i in range(1024)]}),
        ("bad_words 1024", "/v1/chat/completions",
         {"model": MODEL, "messages": CHAT, "max_tokens": 2, "bad_words": [f"word{i} and more" for i in range(1024)]}),
        ("messages 4096", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 50}] * 4096, "max_tokens": 1}),
        ("request chat template", "/v1/chat/completions",
         {"model": MODEL, "messages": CHAT, "max_tokens": 1,
          "chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"}),
        ("fan-out 48 prompts", "/v1/completions", {"model": MODEL, "prompt": ["hi"] * 48, "max_tokens": 1}),
        ("fan-out 2000 x n=128", "/v1/completions", {"model": MODEL, "prompt": ["hi"] * 2000, "n": 128,
                                                     "max_tokens": 1}),
        ("body 20 MB", "/v1/completions", json.dumps({"model": MODEL, "prompt": "z" * 20_000_000}).encode()),
        ("JSON nested 100,000 deep", "/v1/completions", deep),
        ("unsatisfiable grammar", "/v1/chat/completions",
         {"model": MODEL, "messages": CHAT, "max_tokens": 2, "guided_regex": "a[^\\x00-\\x{10FFFF}]"}),
    ]


@dataclass
class Probe:
    """/health every 20 ms and one streaming completion's inter-token gaps, in background threads."""
    url: str
    health_s: list[tuple[float, float]] = field(default_factory=list)  # (start, latency)
    token_t: list[float] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Probe:
        threading.Thread(target=self._health, daemon=True).start()
        threading.Thread(target=self._stream, daemon=True).start()
        return self

    def _health(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self.stop.is_set():
                t = time.monotonic()
                c.get(self.url + "/health")
                self.health_s.append((t, time.monotonic() - t))
                time.sleep(0.02)

    def _stream(self) -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
                "stream": True, "temperature": 1.0}
        with httpx.Client(timeout=600) as c:
            while not self.stop.is_set():  # a new stream whenever one ends (max_model_len)
                with c.stream("POST", self.url + "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            self.token_t.append(time.monotonic())
                        if self.stop.is_set():
                            break
                self.token_t.append(float("nan"))  # a new stream: no gap across it

    def window(self, t0: float, t1: float) -> dict[str, float]:
        lat = [d for s, d in self.health_s if t0 <= s <= t1]
        ts = [t for t in self.token_t if t0 - 1 <= t <= t1 + 1 or t != t]
        gaps = [b - a for a, b in zip(ts, ts[1:]) if a == a and b == b and b >= t0 and a <= t1]
        return {"health_n": len(lat), "health_p99_ms": percentile(lat, 99) * 1e3,
                "health_max_ms": max(lat, default=float("nan")) * 1e3,
                "stream_max_gap_ms": max(gaps, default=float("nan")) * 1e3}


def rss_mb(pid: int) -> float:
    p = psutil.Process(pid)
    return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]) / 2**20


def hostile_phase(url: str, probe: Probe) -> list[dict]:
    rows = []
    with httpx.Client(timeout=120) as c:
        for name, path, body in hostile_requests():
            time.sleep(0.5)
            t0 = time.monotonic()
            if isinstance(body, bytes):
                r = c.post(url + path, content=body, headers={"content-type": "application/json"})
            else:
                r = c.post(url + path, json=body)
            t1 = time.monotonic()
            time.sleep(0.3)
            rows.append({"request": name, "status": r.status_code, "seconds": t1 - t0,
                         **probe.window(t0, t1 + 0.3)})
    return rows


async def _raw_post(host: str, port: int, body: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection(host, port)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    return reader, writer, head + body


async def admission_phase(url: str, n: int, max_tokens: int) -> dict:
    """n concurrent completions at once: every connection is opened first, then every request is written in one
    go, so a request's time is the server's, from its bytes sent to its status line.  503s are refusals (timed),
    200s must all complete."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "Tell me a story", "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()
    conns = [await _raw_post(host, int(port), body) for _ in range(n)]

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> tuple[int, float, int]:
        t = time.monotonic()
        writer.write(request)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        waited = time.monotonic() - t
        rest = await reader.read()
        writer.close()
        done = json.loads(rest.split(b"\r\n\r\n", 1)[1])["usage"]["completion_tokens"] if status == 200 else 0
        return status, waited, done

    results = await asyncio.gather(*[one(*c) for c in conns])
    refused = [s for code, s, _ in results if code == 503]
    ok = [tok for code, _, tok in results if code == 200]
    return {"sent": n, "refused": len(refused), "refused_p50_ms": percentile(refused, 50) * 1e3,
            "refused_max_ms": max(refused, default=0.0) * 1e3,
            "admitted": len(ok), "admitted_completed": sum(t == max_tokens for t in ok),
            "other_statuses": sorted({code for code, _, _ in results} - {200, 503})}


def run(url: str, server_pid: int, max_queued: int, capacity: int, max_tokens: int = 16) -> dict:
    probe = Probe(url).start()
    try:
        time.sleep(1.0)
        rss0 = rss_mb(server_pid)
        hostile = hostile_phase(url, probe)
        rss1 = rss_mb(server_pid)
        admission = asyncio.run(admission_phase(url, 5 * (max_queued + capacity), max_tokens))
        rss2 = rss_mb(server_pid)
    finally:
        probe.stop.set()
    return {"hostile": hostile, "admission": admission, "rss_mb": {"start": rss0, "after_hostile": rss1,
                                                                 "after_admission": rss2}}


def serve(port: int, *flags: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tokenspout.entrypoints.cli", "serve", "--port", str(port),
                             *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(900):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("the server exited during start-up")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-queued-requests", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    args = ap.parse_args()
    port = free_port()
    proc = serve(port, "--max-queued-requests", str(args.max_queued_requests), "--max-num-seqs",
                 str(args.max_num_seqs), "--max-model-len", "2048")
    try:
        res = run(f"http://127.0.0.1:{port}", proc.pid, args.max_queued_requests, args.max_num_seqs)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    print(f"{'hostile request':28} {'status':>6} {'s':>6} {'/health p99':>11} {'max':>7} {'stream gap':>10}")
    for r in res["hostile"]:
        print(f"{r['request']:28} {r['status']:>6} {r['seconds']:>6.2f} {r['health_p99_ms']:>9.1f}ms "
              f"{r['health_max_ms']:>5.0f}ms {r['stream_max_gap_ms']:>8.0f}ms")
    print(json.dumps(res["admission"]), json.dumps({k: round(v) for k, v in res["rss_mb"].items()}))
    path = write_json("chaos.json", {**res, "args": vars(args), "cpus": os.cpu_count()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
