"""Shared bits of the benchmarks: a fixed prompt set, medians, JSON output."""

from __future__ import annotations

import ctypes
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

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
