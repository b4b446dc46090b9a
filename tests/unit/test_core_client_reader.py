"""AsyncMPClient's event-loop reader of the engine's output socket (no engine process: a PUSH socket in a thread).

The reader waits on zmq's file descriptor, which signals a change of the socket's state rather than a level; a
missed wake-up would not lose a message (the 200 ms liveness poll reads it) but would delay it, so every message
must arrive well inside that poll interval, however the sends fall against the reader's waits."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import msgspec
import pytest
import zmq

from tokenspout.core.engine_core_proc import OUTPUTS
from tokenspout.engine import core_client
from tokenspout.engine.core_client import AsyncMPClient
from tokenspout.engine.messages import EngineCoreOutputs


def _reader(ctx: zmq.Context, addr: str) -> AsyncMPClient:
    """An AsyncMPClient around a bound PULL socket, without the engine process it would start."""
    client = object.__new__(AsyncMPClient)
    client.out_sock = ctx.socket(zmq.PULL)
    client.out_sock.setsockopt(zmq.LINGER, 0)
    client.out_sock.bind(addr)
    client._fd = client.out_sock.getsockopt(zmq.FD)
    client._reader_loop = None
    client._tick = None
    client._waiter = None
    client.decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
    client.dead_reason = None
    client.info = None  # (liveness checks: nothing to watch)
    client.last_heard = time.monotonic()
    return client


def _send_all(ctx: zmq.Context, addr: str, n: int, seed: int) -> None:
    """n messages, each stamped with its send time: alone after pauses of 0-3 ms, or in bursts."""
    rng = random.Random(seed)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(addr)
    enc = msgspec.msgpack.Encoder()
    i = 0
    while i < n:
        for _ in range(min(rng.choice([1, 1, 1, 2, 5]), n - i)):
            push.send_multipart([OUTPUTS, enc.encode(EngineCoreOutputs(timestamp=time.monotonic()))])
            i += 1
        time.sleep(rng.choice([0.0, 0.0002, 0.001, 0.003]))
    push.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_every_message_arrives_without_waiting_for_the_poll(tmp_path, seed):
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/out"
    client = _reader(ctx, addr)
    n = 400

    async def consume() -> list[float]:
        delays = []
        for _ in range(n):
            outs = await client.get_output_async()
            delays.append(time.monotonic() - outs.timestamp)
        return delays

    sender = threading.Thread(target=_send_all, args=(ctx, addr, n, seed))
    try:
        sender.start()
        delays = asyncio.run(asyncio.wait_for(consume(), 30))
    finally:
        sender.join()
        client.out_sock.close(linger=0)
        ctx.term()
    assert len(delays) == n
    # a missed wake-up waits for the liveness poll (core_client._POLL_MS): 200 ms
    assert max(delays) < core_client._POLL_MS / 1000 / 2, sorted(delays)[-5:]
    assert client._waiter is None


def test_a_cancelled_wait_leaves_the_reader_until_shutdown(tmp_path):
    """Cancelling the output handler (shutdown, an engine restart) ends the wait; the reader stays registered until
    the client's shutdown removes it: a stale entry would keep the next socket given that number from ever being
    watched."""
    ctx = zmq.Context()
    client = _reader(ctx, f"ipc://{tmp_path}/out")

    async def run() -> None:
        loop = asyncio.get_running_loop()
        task = loop.create_task(client.get_output_async())
        await asyncio.sleep(0.05)
        assert client._reader_loop is loop and client._waiter is not None
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert client._waiter is None and client._reader_loop is loop
        client._drop_reader()  # (what shutdown does first)
        assert client._reader_loop is None and client._tick is None
        assert not loop.remove_reader(client._fd)  # (False: nothing registered for it)

    try:
        asyncio.run(run())
    finally:
        client.out_sock.close(linger=0)
        ctx.term()


def test_an_idle_reader_neither_spins_nor_misses_the_liveness_check(tmp_path, monkeypatch):
    """Between messages the descriptor must go quiet (the reader takes the socket's state in each time it is called:
    otherwise the loop calls it on every turn, a busy loop while no read waits), and a read that waits still checks
    the engine every _POLL_MS."""
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/out"
    client = _reader(ctx, addr)
    calls = {"readable": 0, "alive": 0}
    on_readable = client._on_readable

    def counted() -> None:
        calls["readable"] += 1
        on_readable()

    client._on_readable = counted  # type: ignore[method-assign]
    monkeypatch.setattr(client, "_check_alive", lambda: calls.__setitem__("alive", calls["alive"] + 1))

    async def run() -> None:
        sender = threading.Thread(target=_send_all, args=(ctx, addr, 20, 2))
        sender.start()
        for _ in range(20):
            await client.get_output_async()
        sender.join()
        await asyncio.sleep(0.05)  # (the last sends' signals)
        before = calls["readable"]
        await asyncio.sleep(0.3)  # no read waits, no message comes
        assert calls["readable"] - before <= 2, calls
        calls["alive"] = 0  # (a tick may have fallen on a read waiting for one of the messages above)
        waiting = asyncio.get_running_loop().create_task(client.get_output_async())
        await asyncio.sleep(core_client._POLL_MS / 1000 * 2.6)
        assert 1 <= calls["alive"] <= 3, calls  # two or three ticks (fewer only on a starved loop), never a spin
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        client._drop_reader()

    try:
        asyncio.run(run())
    finally:
        client.out_sock.close(linger=0)
        ctx.term()
