"""Clients of the engine core: one interface, three transports.

* InprocClient: the EngineCore in this process (tests, simple offline use); get_output() steps it.
* SyncMPClient: EngineCoreProc in a spawned process over ZMQ, blocking calls (offline LLM).
* AsyncMPClient: the same process, read from an asyncio event loop (AsyncLLM / the API server).

The MP clients watch the engine process: if it dies, get_output() raises EngineDeadError instead of hanging.  They
also watch its heartbeat (the engine sends something at least every HEARTBEAT_S): silence for `hang_timeout_s`
means the engine is hung (stopped, frozen); the client then kills it and reports it dead, so the frontend can fail
its requests and restart it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref

import msgspec
import zmq

from tokenspout.config import EngineConfig
from tokenspout.core.engine_core_proc import ABORT, ADD, FAILED, HEARTBEAT_S, OUTPUTS, READY, UTILITY, EngineReady
from tokenspout.engine.exceptions import EngineDeadError
from tokenspout.engine.messages import EngineCoreAbort, EngineCoreOutputs, EngineCoreRequest, EngineCoreUtility

logger = logging.getLogger(__name__)

_POLL_MS = 200  # how often a waiting client checks that the engine process is alive
DEFAULT_HANG_TIMEOUT_S = 30.0  # --engine-hang-timeout: no heartbeat for this long = hung


class InprocClient:
    def __init__(self, config: EngineConfig, loaded=None):
        from tokenspout.core.engine_core import EngineCore

        self.core = EngineCore(config, loaded)
        lm = self.core.loaded
        self.info = EngineReady(self.core.max_model_len, lm.arch.vocab_size, self.core.kv.num_blocks,
                                self.core.kv.block_size, str(lm.dtype), lm.name, str(lm.path))

    def add_request(self, req: EngineCoreRequest) -> None:
        self.core.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.core.step()

    @property
    def is_alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.core.shutdown()


def engine_env() -> dict[str, str]:
    """The engine process's environment: OpenMP threads sleep at barriers (OMP_WAIT_POLICY=PASSIVE) unless the
    user chose otherwise.  Why: on a small CPU the engine's threads share cores with the API server (and anything
    else); spinning threads keep a core busy, so a thread that lost its core holds every barrier for a whole
    scheduler slice.  Measured here with one core taken by another process: a decode step's layer stack took
    ~0.5-1.2 s with the default spin-waiting and 19 ms with PASSIVE (13 ms on one thread alone).  This governs the
    fork/join of each parallel region (a few per step); the barriers inside the C decode kernels' layer stack are
    their own (a bounded, adaptive spin: kernels/csrc/decode_cpu.c)."""
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def _cleanup(proc: subprocess.Popen, ipc_dir: str) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    shutil.rmtree(ipc_dir, ignore_errors=True)


class _MPBase:
    """Starts the engine process, waits for READY, owns the two sockets and the process's lifetime."""

    def __init__(self, config: EngineConfig, ready_timeout_s: float = 600.0, on_wait=None, wait: bool = True,
                 hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S):
        """wait=False: start the engine process and return; call wait_ready() before using the client (the
        caller loads its tokenizer meanwhile, in parallel with the engine's start-up).  hang_timeout_s: silence
        (no output, no heartbeat) after READY for this long marks the engine hung; at least 2 heartbeats."""
        if not hang_timeout_s >= 2 * HEARTBEAT_S:
            raise ValueError(f"the engine hang timeout must be at least {2 * HEARTBEAT_S:g} s, got {hang_timeout_s}")
        self.hang_timeout_s = hang_timeout_s
        self.last_heard = time.monotonic()
        self.ipc_dir = tempfile.mkdtemp(prefix="tokenspout-")
        input_addr, output_addr = f"ipc://{self.ipc_dir}/in", f"ipc://{self.ipc_dir}/out"
        self.ctx = zmq.Context()
        self.in_sock = self.ctx.socket(zmq.PUSH)
        self.in_sock.setsockopt(zmq.LINGER, 0)
        self.in_sock.bind(input_addr)
        self.out_sock = self.ctx.socket(zmq.PULL)
        self.out_sock.setsockopt(zmq.LINGER, 0)
        self.out_sock.bind(output_addr)
        # A fresh interpreter (spawned, not forked): no inherited threads or sockets, and unlike multiprocessing's
        # spawn it does not re-import the user's __main__ (scripts need no `if __name__ == "__main__"` guard).
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenspout.core.engine_core_proc", msgspec.json.encode(config).decode(),
             input_addr, output_addr, str(os.getpid())], env=engine_env())
        self._finalizer = weakref.finalize(self, _cleanup, self.proc, self.ipc_dir)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.dead_reason: str | None = None
        self.ready_timeout_s = ready_timeout_s
        self.info: EngineReady | None = None
        if wait:
            self.wait_ready(on_wait)

    def wait_ready(self, on_wait=None) -> EngineReady:
        """Blocks until the engine has loaded its model (READY); raises RuntimeError if it failed or exited."""
        if self.info is None:
            self.info = self._wait_ready(self.ready_timeout_s, on_wait)
        return self.info

    def _wait_ready(self, timeout_s: float, on_wait) -> EngineReady:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self._poll_ready(_POLL_MS)
            if info is not None:
                return info
            if on_wait is not None:
                on_wait()
        self.shutdown()
        raise RuntimeError(f"engine did not start within {timeout_s:.0f} s")

    def _poll_ready(self, timeout_ms: int) -> EngineReady | None:
        """One look for READY (waiting up to timeout_ms); raises RuntimeError if the engine failed or exited."""
        if self.out_sock.poll(timeout_ms):
            kind, payload = self.out_sock.recv_multipart()
            if kind == READY:
                self.last_heard = time.monotonic()
                return msgspec.msgpack.decode(payload, type=EngineReady)
            if kind == FAILED:
                self.shutdown()
                raise RuntimeError(f"engine failed to start: {msgspec.msgpack.decode(payload)}")
        elif self.proc.poll() is not None:
            self.shutdown()
            raise RuntimeError(f"engine process exited during start-up (exit code {self.proc.returncode})")
        return None

    def try_ready(self) -> bool:
        """Non-blocking wait_ready for event-loop callers (wait_ready_async): True once READY arrived."""
        if self.info is None:
            self.info = self._poll_ready(0)
        return self.info is not None

    @property
    def is_alive(self) -> bool:
        self._notice_death()
        return self.dead_reason is None

    def _notice_death(self) -> None:
        if self.dead_reason is not None or self.info is None:
            return
        if self.proc.poll() is not None:
            self.dead_reason = f"engine process died (exit code {self.proc.returncode})"
        elif (silent := time.monotonic() - self.last_heard) > self.hang_timeout_s and not self._pending():
            self.dead_reason = f"engine hung: no heartbeat for {silent:.1f} s (limit {self.hang_timeout_s:g} s)"
            self.proc.kill()  # never let it resume (SIGCONT) and send outputs for requests already failed
        else:
            return
        logger.error(self.dead_reason)

    def _pending(self) -> bool:
        """A message waits to be read: the engine spoke, this process has not listened (a busy or idle frontend)."""
        try:
            return bool(int(self.out_sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
        except zmq.ZMQError:
            return False

    def _check_alive(self) -> None:
        self._notice_death()
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def _decode_outputs(self, frames) -> EngineCoreOutputs:
        self.last_heard = time.monotonic()
        kind, payload = frames
        if bytes(kind) != OUTPUTS:
            raise EngineDeadError(f"unexpected message {bytes(kind)!r} from the engine")
        out = self.decoder.decode(payload)
        if out.engine_error is not None:
            self.dead_reason = f"engine core failed: {out.engine_error}"
            logger.error(self.dead_reason)
        return out

    def _send(self, kind: bytes, msg) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self.in_sock.send_multipart([kind, self.encoder.encode(msg)], copy=False)

    def add_request(self, req: EngineCoreRequest) -> None:
        self._send(ADD, req)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None:
            self._send(ABORT, EngineCoreAbort(list(request_ids)))

    def kill(self) -> None:
        """At once (a second SIGTERM): SIGKILL the engine process and remove its IPC folder."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def _frozen(self) -> bool:
        """Silent past three heartbeats with nothing unread (stopped, or stuck where its output thread cannot run):
        a request to stop would go unanswered, and a SIGTERM stays pending in a stopped process."""
        return (self.info is not None and time.monotonic() - self.last_heard > 3 * HEARTBEAT_S
                and not self._pending())

    def shutdown(self) -> None:
        if self.proc.poll() is None and self.dead_reason is None:
            if self._frozen():
                # (waiting for it took the server's exit 10 s past its --shutdown-timeout: 5 s for the answer, 5
                # for the SIGTERM)
                logger.warning("engine silent for %.1f s at shutdown: killed", time.monotonic() - self.last_heard)
                self.kill()
            else:
                try:
                    self.in_sock.send_multipart([UTILITY, self.encoder.encode(EngineCoreUtility("shutdown"))],
                                                flags=zmq.NOBLOCK)
                    self.proc.wait(5)
                except (zmq.ZMQError, subprocess.TimeoutExpired):
                    pass
        self._finalizer()
        for s in (self.in_sock, self.out_sock):
            s.close(linger=0)


async def wait_ready_async(client, timeout_s: float = 600.0) -> EngineReady:
    """wait_ready without blocking the event loop: polls every engine of `client` (an AsyncMPClient or a data-parallel
    client with .engines).  A cancelled wait leaves the client to the caller (shut it down in the loop's thread)."""
    deadline = time.monotonic() + timeout_s
    for engine in getattr(client, "engines", [client]):
        while not engine.try_ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine did not start within {timeout_s:.0f} s")
            await asyncio.sleep(_POLL_MS / 1000)
    return client.wait_ready()  # every engine is ready: returns at once


class SyncMPClient(_MPBase):
    def get_output(self) -> EngineCoreOutputs:
        while not self.out_sock.poll(_POLL_MS):
            self._check_alive()
        return self._decode_outputs(self.out_sock.recv_multipart(copy=False))


class AsyncMPClient(_MPBase):
    """Reads the output socket from the event loop without zmq.asyncio: a reader on the socket's file descriptor,
    registered with the loop once and kept until shutdown, wakes the one waiting read; a read takes a message when
    the socket's EVENTS say one is there, else waits for that wake-up (or the liveness tick).  zmq.asyncio's futures
    (a poll, then a recv, each through its event bookkeeping) cost the API server ~0.15 ms more CPU per engine
    message, and a reader added and removed around every wait (with its own timeout timer, and a recv that failed
    with an exception before it) ~0.04-0.07 ms more: at one client that is per token, CPU taken from the decode
    threads on a small machine (README, "Engine")."""

    def __init__(self, config: EngineConfig, **kw):
        super().__init__(config, **kw)
        fd = self.out_sock.getsockopt(zmq.FD)
        assert isinstance(fd, int)  # (typed int | bytes: getsockopt's type for every option)
        self._fd = fd
        self._reader_loop: asyncio.AbstractEventLoop | None = None  # the loop the reader is registered with
        self._tick: asyncio.TimerHandle | None = None  # the liveness tick, every _POLL_MS while registered
        self._waiter: asyncio.Future[bool] | None = None  # the read waiting for the socket (at most one)

    def shutdown(self) -> None:
        # The reader first: closed under it, the loop kept a stale entry for the descriptor, and the next socket to
        # reuse that number (an HTTP connection accepted right after a dead engine was replaced) was never watched:
        # its request hung (epoll forgets a closed descriptor, asyncio's map of them does not).
        self._drop_reader()
        super().shutdown()

    def _drop_reader(self) -> None:
        loop, self._reader_loop = self._reader_loop, None
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._fd)

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Registers the reader and the liveness tick with `loop` (once per loop: a new one takes them over)."""
        if self._reader_loop is not loop:
            self._drop_reader()
            loop.add_reader(self._fd, self._on_readable)
            self._reader_loop = loop
            self._tick = loop.call_later(_POLL_MS / 1000, self._on_tick)

    def _on_readable(self) -> None:
        """zmq's descriptor signals a change of the socket's state and stays readable until the socket takes it in:
        EVENTS does that (without it the loop would call back on every turn while no read waits), and the next
        change signals again."""
        try:
            self.out_sock.getsockopt(zmq.EVENTS)
        except zmq.ZMQError:
            pass  # (closed under it: the waiter's next check says so)
        _wake(self._waiter, True)

    def _on_tick(self) -> None:
        loop = self._reader_loop
        if loop is not None:
            self._tick = loop.call_later(_POLL_MS / 1000, self._on_tick)
        _wake(self._waiter, False)

    async def get_output_async(self) -> EngineCoreOutputs:
        loop = asyncio.get_running_loop()
        self._watch(loop)
        while not int(self.out_sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            # Nothing there, and EVENTS has taken in the socket's state: the next message signals the
            # descriptor, however soon it comes, and no loop turn runs between this check and the await.
            waiter = self._waiter = loop.create_future()
            try:
                if not await waiter:
                    self._check_alive()
            finally:
                self._waiter = None
        return self._decode_outputs(self.out_sock.recv_multipart(zmq.NOBLOCK, copy=False))


def _wake(fut: asyncio.Future[bool] | None, value: bool) -> None:
    if fut is not None and not fut.done():
        fut.set_result(value)
