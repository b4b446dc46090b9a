"""The engine process never exits with its warm-up thread inside native code: stopped in the ~2.5 s after READY,
Python's exit ended that daemon thread mid C++ frame ("terminate called without an active exception", SIGABRT or
SIGSEGV: about 1 in 16 SIGTERMs 0-1 s after /health answered, audit 2026-11-27).  EngineCoreProc.run waits for it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import zmq

from tokenspout.core.engine_core_proc import EngineCoreProc


class _SlowWarmUp:
    def __init__(self) -> None:
        self.loaded = SimpleNamespace(write_cache=None)
        self.warmed = threading.Event()

    def warm_up(self) -> None:
        time.sleep(0.8)  # (the tokenizer and llguidance's view of it, built in native code)
        self.warmed.set()

    def has_unfinished_requests(self) -> bool:
        return False

    def stats(self):
        return None


def test_run_waits_for_the_warm_up_before_it_returns():
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://in")
    push.bind("inproc://out")
    sink = ctx.socket(zmq.PULL)  # (the frontend's end: takes what the output thread sends)
    sink.connect("inproc://out")
    core = _SlowWarmUp()
    proc = EngineCoreProc(core, pull, push, parent_pid=-1)
    stopper = threading.Timer(0.1, proc.stopping.set)
    stopper.start()
    started = time.monotonic()
    proc.run()
    assert core.warmed.is_set() and not proc.warm_up_running
    assert time.monotonic() - started < 5
    sink.close(linger=0)
    ctx.term()
