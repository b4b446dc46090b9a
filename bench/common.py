"""Shared bits of the benchmarks: a fixed prompt set, medians, JSON output, a tokenspout server started and stopped."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    import torch

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent

_TOPICS = ["the history of the printing press", "how vaccines train the immune system", "the rules of chess",
           "why the sky is blue", "how a compiler turns source code into machine code", "the water cycle",
           "the causes of the French Revolution", "how neural networks learn", "the life cycle of a star",
           "how bread rises", "the economics of supply and demand", "how GPS finds your position",
           "the architecture of Gothic cathedrals", "why leaves change colour in autumn",
           "how the internet routes packets", "the theory of plate tectonics"]
_STYLES = ["Explain {t} to a curious twelve-year-old, with one everyday analogy and one surprising fact.",
           ("Write a detailed, well-structured essay about {t}. Start with an overview, then cover the key ideas "
           "in order, and end with open questions that researchers still argue about today."),
           "You are a patient teacher. A student asks about {t}. Answer step by step and check understanding.",
           "Summarise what an educated adult should know about {t}, in plain words, in several paragraphs."]


def prompts(n: int, tokenizer=None, target_tokens: int | None = None) -> list[str]:
    """n varied English prompts; with a tokenizer and target_tokens, each is padded with context to about that
    many tokens."""
    out = []
    for i in range(n):
        p = _STYLES[i % len(_STYLES)].format(t=_TOPICS[i % len(_TOPICS)])
        if tokenizer is not None and target_tokens:
            filler = f" Background notes ({i}): " + " ".join(_TOPICS[(i + j) % len(_TOPICS)] for j in range(40))
            while len(tokenizer(p).input_ids) < target_tokens:
                p += filler
            ids = tokenizer(p).input_ids[:target_tokens]
            p = tokenizer.decode(ids)
        out.append(p)
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def write_json(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"machine": platform.machine(), "processor": platform.processor(), "time": time.time(), **data}
    path = RESULTS / name
    path.write_text(json.dumps(data, indent=2))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tokenspout(flags: list[str], tree: Path | None = None,
                     log: Path | None = None) -> tuple[subprocess.Popen, str, float]:
    """`tokenspout serve FLAGS` on a free port, in its own session group, until /health answers: (process, base url,
    seconds to healthy).  tree: another checkout's tokenspout (its folder on PYTHONPATH, the server run there);
    log: where its output goes (else nowhere)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(tree)) if tree is not None else None
    t0 = time.monotonic()
    with open(log, "w") if log is not None else open(os.devnull, "w") as out:  # (the child holds its own copy)
        proc = subprocess.Popen([sys.executable, "-m", "tokenspout.entrypoints.cli", "serve", "--port", str(port),
                                 *flags], cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() - t0 < 300:
        if proc.poll() is not None:
            stop_server(proc)  # a Ray server that failed may leave its cluster's processes in its group
            raise RuntimeError(f"tokenspout serve {' '.join(flags)} exited ({proc.returncode})"
                               + (f"; see {log}" if log is not None else ""))
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop_server(proc)
    raise RuntimeError("server did not become healthy")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server only (a Ray server then removes its app and stops the cluster it started: signalling
    the cluster's processes too would leave it talking to a dead GCS), then whatever is left of its group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def built_library(so: Path, isa: str, defines: tuple[str, ...] = (), csrc: Path | None = None) -> ctypes.CDLL:
    """A variant of the C kernels built for `isa` into `so` (cpu._build: `defines`, or the sources of another folder)
    and loaded with today's argument types for the calls the benchmarks time."""
    from tokenspout.kernels import cpu

    cpu._build(so, defines=defines, isa=isa, csrc=csrc or cpu.CSRC)
    lib, now = ctypes.CDLL(str(so)), cpu.load(isa)
    assert now is not None
    for name in ("ts_linear", "ts_attn_decode"):
        getattr(lib, name).argtypes = getattr(now, name).argtypes
        getattr(lib, name).restype = None
    return lib


def library_at(rev: str, tmp: Path, isa: str) -> ctypes.CDLL:
    """The C kernels of git revision `rev` (its tokenspout/kernels/csrc), built for `isa` into `tmp`: benchmarks time
    it beside today's library (`--against REV`)."""
    from tokenspout.kernels import cpu

    src = tmp / f"csrc-{rev}"
    src.mkdir()
    for path in cpu.SOURCES + cpu.HEADERS:
        rel = path.relative_to(ROOT).as_posix()
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{rel}"], capture_output=True, check=True).stdout
        (src / path.name).write_bytes(text)
    return built_library(tmp / f"decode_cpu-{rev}.so", isa, csrc=src)


def q6k_raw(q: torch.Tensor, sub: torch.Tensor, d: torch.Tensor):
    """Q6_K super-blocks (numpy uint8 rows [N, K/256 * 210], the GGUF layout) of codes q [N, K] (0..63), sub-block
    scales sub [N, K/16] (int8) and d [N, K/256] (float16): W = d * sub * (q - 32)."""
    import numpy as np
    import torch

    n, k = q.shape
    s = k // 256
    qb = q.to(torch.uint8).view(n, s, 2, 4, 32)  # [N, super-block, half h, chunk c, l]: element 128h + 32c + l
    low = qb & 15
    ql = torch.cat([low[:, :, :, 0] | (low[:, :, :, 2] << 4), low[:, :, :, 1] | (low[:, :, :, 3] << 4)], -1)
    qh = sum(((qb[:, :, :, c] >> 4) << (2 * c)) for c in range(4)).to(torch.uint8)  # [N, S, 2, 32]
    parts = [ql.reshape(n, s, 128), qh.reshape(n, s, 64), sub.to(torch.int8).view(torch.uint8).view(n, s, 16),
             d.to(torch.float16).view(torch.uint8).view(n, s, 2)]
    return np.ascontiguousarray(torch.cat(parts, -1).reshape(n, s * 210).numpy())


def q6k_fit(w: torch.Tensor, negate: bool = True):
    """w [N, K] (K a multiple of 256) fitted as Q6_K: a float16 d per 256 columns, an int8 sub-scale per 16 (negate:
    every other one negative, as llama.cpp's quantizer makes the largest -128), codes 0..63.  The gguf package has no
    Q6_K quantizer.  Returns (raw rows as a GGUF file holds them, their values float32 [N, K])."""
    import torch

    n, k = w.shape
    sub_amax = w.float().abs().view(n, k // 16, 16).amax(-1)
    d = (sub_amax.view(n, k // 256, 16).amax(-1) / (32 * 127)).half()
    dd = d.float().repeat_interleave(16, 1)
    sub = torch.where(dd > 0, torch.round(sub_amax / 32 / dd.clamp_min(1e-30)), 0).clamp(-127, 127)
    if negate:
        sub[:, 1::2] *= -1
    step = (dd * sub).repeat_interleave(16, 1)
    q = (torch.where(step != 0, torch.round(w.float() / torch.where(step != 0, step, 1)), 0) + 32).clamp(0, 63)
    values = (d.double().repeat_interleave(256, 1) * sub.double().repeat_interleave(16, 1) * (q.double() - 32)).float()
    return q6k_raw(q, sub, d), values


def q6k_int6(w: torch.Tensor, lib, negate: bool = True):
    """w fitted as Q6_K (q6k_fit) and converted by the C kernels `lib` as a GGUF file's Q6_K is (cpu.q6k_into):
    (packed int6 weight, the Q6_K values float32 [N, K], raw rows)."""
    from tokenspout.kernels import cpu
    from tokenspout.models.quantize import empty_packed

    n, k = w.shape
    raw, values = q6k_fit(w, negate)
    packed = empty_packed(n, k, cpu.WT_Q6)
    assert cpu.q6k_into(lib, raw, None, k, 0, packed.codes, packed.scale) == n
    return packed, values, raw
