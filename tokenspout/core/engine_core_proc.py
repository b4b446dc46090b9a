"""EngineCoreProc: the engine core in its own (spawned) process, a busy loop behind two ZMQ sockets.

Wire format: multipart [kind, msgpack payload].  Frontend -> engine kinds: ADD (EngineCoreRequest),
ABORT (EngineCoreAbort), UTILITY (EngineCoreUtility).  Engine -> frontend: OUTPUTS (EngineCoreOutputs),
READY (EngineReady, once after loading) or FAILED (a string, if loading failed).

Threads: an input thread decodes messages into a queue (so deserialisation overlaps the model step); the main
thread steps and sends each step's outputs itself, at once (a few us of msgpack; the socket is locked, since the
output thread sends too).  Handed to the output thread instead, they were encoded and sent only once the next step
had entered the kernels and released the GIL, by a thread that then took a core from them: served c=1 on the
2-core AVX2 EPYC, five rounds alternated, 1.00x / 1.05x / 1.10x / 1.11x / 1.16x the tok/s of the hand-over.  The
output thread sends the rest (a rejected request's output, a crash's error) and the heartbeats; the main thread
also sends the scheduler's stats when it goes idle (after a step's outputs, in order).  When idle the
main thread blocks on the input queue; the input thread polls the parent pid so that a dead frontend never leaves
an orphan engine (nor its IPC folder).

Heartbeat: the output thread sends an empty EngineCoreOutputs whenever its queue stayed empty for HEARTBEAT_S, idle
or busy.  It runs beside the steps (the kernels and torch release the GIL), so a long step (a big model's prefill
chunk) still beats, while a stopped or frozen process (SIGSTOP, a stall of the whole VM) falls silent: the
frontend's --engine-hang-timeout turns that silence into "engine hung".
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from tokenspout.config import EngineConfig
from tokenspout.engine.messages import EngineCoreAbort, EngineCoreOutputs, EngineCoreRequest, EngineCoreUtility
from tokenspout.platform import freeze_startup_heap, return_large_frees_to_the_os

logger = logging.getLogger(__name__)

ADD, ABORT, UTILITY, OUTPUTS, READY, FAILED = b"A", b"X", b"U", b"O", b"R", b"F"
HEARTBEAT_S = 1.0  # the longest the engine stays silent


class EngineReady(msgspec.Struct):
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    dtype: str
    model_name: str
    model_path: str


_decoders: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
    ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
    ABORT: msgspec.msgpack.Decoder(EngineCoreAbort),
    UTILITY: msgspec.msgpack.Decoder(EngineCoreUtility),
}


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int) -> None:
    """Process entry point (spawned)."""
    logging.basicConfig(level=os.environ.get("TOKENSPOUT_LOG_LEVEL", "INFO"),
                        format="%(asctime)s engine %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend decides when we stop (SIGTERM / shutdown)
    return_large_frees_to_the_os()
    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 1000)
    out_sock.connect(output_addr)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.connect(input_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        from tokenspout.core.engine_core import EngineCore

        core = EngineCore(config, defer_cache_write=True)
    except BaseException as e:  # noqa: BLE001 - report any load failure to the frontend, then exit
        logger.error("engine failed to start: %s", e)
        out_sock.send_multipart([FAILED, encoder.encode(f"{type(e).__name__}: {e}")])
        out_sock.close()
        ctx.term()
        return
    freeze_startup_heap()
    loaded = core.loaded
    out_sock.send_multipart([READY, encoder.encode(EngineReady(
        core.max_model_len, loaded.arch.vocab_size, core.kv.num_blocks, core.kv.block_size, str(loaded.dtype),
        loaded.name, str(loaded.path)))])
    proc = EngineCoreProc(core, in_sock, out_sock, parent_pid)
    proc.run()
    ctx.term()
    if proc.orphaned:
        _remove_ipc_dir(input_addr)
    if proc.warm_up_running:  # still in native code after the wait: leave without ending it mid-frame
        logger.warning("warm-up still running at exit; exiting without interpreter shutdown")
        logging.shutdown()
        os._exit(0)


_WARM_UP_JOIN_S = 30.0  # warm_up takes ~2.5 s; the frontend waits for the engine's exit (then terminates it)


def _remove_ipc_dir(addr: str) -> None:
    """The frontend died without cleaning up (kill -9): remove the IPC folder it made for us (tempfile's
    tokenspout-* folder holding the two sockets), so no leftovers stay in /tmp."""
    folder = os.path.dirname(addr.removeprefix("ipc://"))
    if os.path.basename(folder).startswith("tokenspout-"):
        shutil.rmtree(folder, ignore_errors=True)


def _tune_malloc() -> None:
    """Keep freed large buffers in the heap: by default glibc maps every allocation over 32 MiB (e.g. [256, 128k]
    float32 logits) afresh and pays its page faults on every step (~100 ms per 131 MB here)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 31)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        logger.debug("mallopt unavailable; keeping the default allocator settings")


def main() -> None:
    """`python -m tokenspout.core.engine_core_proc CONFIG_JSON INPUT_ADDR OUTPUT_ADDR PARENT_PID` (started by the
    MP clients as a fresh interpreter: spawned, never forked, and the user's __main__ is not re-imported)."""
    import sys

    _tune_malloc()
    config_json, input_addr, output_addr, parent_pid = sys.argv[1:5]
    config = msgspec.json.decode(config_json.encode(), type=EngineConfig)
    run_engine_core(config, input_addr, output_addr, int(parent_pid))


class EngineCoreProc:
    def __init__(self, core, in_sock: zmq.Socket, out_sock: zmq.Socket, parent_pid: int):
        self.core = core
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.parent_pid = parent_pid
        self.inputs: queue.Queue = queue.Queue()
        self.outputs: queue.Queue = queue.Queue()
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self.stopping = threading.Event()
        self.orphaned = False  # set when the frontend process went away
        self._warming: threading.Thread | None = None  # warm_up(), started beside the first steps

    def run(self) -> None:
        reader = threading.Thread(target=self._input_loop, daemon=True, name="engine-input")
        reader.start()
        sender = threading.Thread(target=self._output_loop, daemon=True, name="engine-output")
        sender.start()
        try:
            self._busy_loop()
        except BaseException as e:  # noqa: BLE001 - a crash must reach the frontend, not vanish
            logger.error("engine core crashed:\n%s", traceback.format_exc())
            self.outputs.put(EngineCoreOutputs(engine_error=f"{type(e).__name__}: {e}"))
        finally:
            self.stopping.set()
            self.outputs.put(None)
            sender.join(timeout=5)
            reader.join(timeout=2)  # it polls with a timeout and sees `stopping`; then its socket can close
            self.in_sock.close(linger=0)
            self.out_sock.close()
            if self._warming is not None:
                # An engine stopped in the ~2.5 s after READY exited with warm_up still building the tokenizer and
                # llguidance's view of it in native code: Python's exit ended that daemon thread inside C++ frames
                # ("terminate called without an active exception", SIGABRT, sometimes SIGSEGV; audit 2026-11-27).
                self._warming.join(timeout=_WARM_UP_JOIN_S)

    @property
    def warm_up_running(self) -> bool:
        return self._warming is not None and self._warming.is_alive()

    def _busy_loop(self) -> None:
        core = self.core
        last_stats = None
        # Right after READY, beside the steps: load what the first grammar request needs (the tokenizer, the grammar
        # manager and its llguidance tokenizer, ~2.5 s), so that request never builds them on the step loop's
        # thread.  (Built lazily there, the first grammar request of a busy engine held the GIL ~0.4-1.4 s: a
        # 418 ms gap in another request's stream, bench.chaos.)  Its Python gives the GIL back every few ms.
        self._warming = threading.Thread(target=self._warm_up, name="engine-warm-up", daemon=True)
        self._warming.start()
        # A first start's quantized-weights cache file is written now, beside the steps (its file writes release
        # the GIL): ready 3.5 s (1.7B) to 20+ s (8B) sooner on this VM.  Not a daemon: an engine that stops
        # meanwhile finishes the file before it exits (one killed leaves a temporary file the next writer removes).
        write = core.loaded.write_cache
        if write is not None:
            core.loaded.write_cache = None
            threading.Thread(target=write, name="engine-cache-write").start()
        while not self.stopping.is_set():
            block = not core.has_unfinished_requests()
            try:
                item = self.inputs.get(timeout=1.0) if block else self.inputs.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                self._handle(item)
                try:
                    item = self.inputs.get_nowait()
                except queue.Empty:
                    item = None
            if self.stopping.is_set():
                break
            if core.has_unfinished_requests():
                out = core.step()
                if out.outputs or out.scheduler_stats != last_stats:
                    self._send(out)
                    last_stats = out.scheduler_stats
            elif last_stats is None or last_stats.num_running or last_stats.num_waiting:
                last_stats = core.stats()  # went idle (e.g. after aborts): tell the frontend
                self._send(EngineCoreOutputs(scheduler_stats=last_stats, timestamp=time.monotonic()))

    def _warm_up(self) -> None:
        try:
            self.core.warm_up()
        except Exception as e:  # noqa: BLE001 - optional: a grammar request will report the real error
            logger.warning("warm-up failed: %s", e)

    def _handle(self, item) -> None:
        kind, msg = item
        if kind == ADD:
            try:
                self.core.add_request(msg)
            except ValueError as e:
                # The frontend validated already; a duplicate id is the only way here.  Fail that request only.
                from tokenspout.engine.messages import EngineCoreOutput

                logger.warning("rejected request %s: %s", msg.request_id, e)
                self.outputs.put(EngineCoreOutputs(outputs=[EngineCoreOutput(msg.request_id, [], finish_reason="error")]))
        elif kind == ABORT:
            self.core.abort_requests(msg.request_ids)
        elif kind == UTILITY and msg.name == "shutdown":
            self.stopping.set()

    def _input_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.in_sock, zmq.POLLIN)
        while not self.stopping.is_set():
            if not poller.poll(500):
                if os.getppid() != self.parent_pid:  # the frontend died: do not linger as an orphan
                    logger.error("frontend process is gone; engine exiting")
                    self.orphaned = True
                    self.stopping.set()
                    self.inputs.put((UTILITY, EngineCoreUtility("shutdown")))
                continue
            kind_frame, payload = self.in_sock.recv_multipart(copy=False)
            kind = kind_frame.bytes
            try:
                self.inputs.put((kind, _decoders[kind].decode(payload.buffer)))
            except (msgspec.DecodeError, KeyError) as e:  # (ValidationError is a DecodeError)
                self._reject(kind, payload.buffer, e)

    def _reject(self, kind: bytes, payload: Any, error: Exception) -> None:
        """A message the engine cannot decode (an offline SamplingParams field of the wrong type, e.g.
        logprobs=2.5, reached it unchecked): this thread stayed alive no longer and every later request hung.  An
        ADD fails its own request as bad input (the frontend raises it); anything else is logged and dropped."""
        logger.warning("engine input of kind %r rejected: %s", kind, error)
        if kind != ADD:
            return
        try:
            request_id = msgspec.msgpack.decode(payload)[0]  # (EngineCoreRequest is array-like: its id first)
        except (msgspec.DecodeError, IndexError, KeyError, TypeError):
            return
        if isinstance(request_id, str):
            from tokenspout.engine.messages import EngineCoreOutput

            self.outputs.put(EngineCoreOutputs(outputs=[EngineCoreOutput(
                request_id, [], finish_reason="error", stop_reason=f"the engine rejected the request: {error}")]))

    def _output_loop(self) -> None:
        while True:
            try:
                out = self.outputs.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                out = EngineCoreOutputs()  # heartbeat: alive, nothing to say
            if out is None:
                return
            self._send(out)

    def _send(self, out: EngineCoreOutputs) -> None:
        """Encodes and sends, from the main thread (a step's outputs, see the module's docstring: Threads) or the
        output thread: the lock serialises the socket and the one encoder."""
        with self._send_lock:
            self.out_sock.send_multipart([OUTPUTS, self._encoder.encode(out)], copy=False)


if __name__ == "__main__":
    main()
