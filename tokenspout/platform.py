"""What this machine can do, detected rather than guessed."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16() -> bool:
    """True where the CPU has bf16 matrix instructions (AVX512-BF16 or AMX-BF16)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def return_large_frees_to_the_os() -> None:
    """Fixes glibc's mmap threshold at 1 MiB (mallopt M_MMAP_THRESHOLD), which also turns off its dynamic raising.
    Why: loading a model frees many buffers of a few MB (a quantized chunk, a dequantized tensor); by default each
    such free raises the threshold, later buffers of that size come from the heap, and the heap keeps the pages:
    a 1.7B model's engine kept 1.0-1.5 GB it no longer used after loading.  Allocations of 1 MiB and more are then
    always their own mappings, returned to the system when freed.  No-op where glibc's mallopt is missing."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = -3
    except (OSError, AttributeError):
        pass


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (torch, transformers, the model's modules: ~200,000 tracked objects)
    out of the garbage collector's reach.  A full collection walks all of them, ~57 ms here, and the per-step
    allocations of a busy engine or API server trigger one every few seconds: a stall in the middle of a stream.
    Objects created later are collected as usual."""
    import gc

    gc.collect()
    gc.freeze()


def trim_heap() -> None:
    """Gives the free pages of every malloc arena back to the system (glibc malloc_trim(0)).  Why: a big request's
    many small allocations (a 7 MB prompt's encoding: a string and offsets per token, ~1.8M of them) are freed into
    the worker thread's arena, which keeps them: the API server held +0.6-1.3 GB after one such request.  A few ms
    for a GB heap; no-op where malloc_trim is missing."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass

