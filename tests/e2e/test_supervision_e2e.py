"""Engine supervision and shutdown, as an operator meets them (issue: hostile input and faults).

* a killed engine (kill -9) fails its in-flight requests, is restarted, and the server serves again; /metrics
  counts the restart; with --no-engine-restart the server process exits non-zero instead;
* a stopped engine (SIGSTOP) falls silent: /health answers 503 within the hang limit, then it is restarted;
* SIGTERM with long streams in flight: every stream ends with an error frame and [DONE] at the deadline, the server
  exits within the deadline + 5 s, leaving no process and no IPC folder behind; a second SIGTERM exits at once; a
  stopped engine does not hold the exit past the deadline;
* kill -9 of the server: its engine notices, exits and removes the IPC folder.
Real engine processes on the default model; short generations.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.helpers import background_server, real_engine

SERVE_ARGS = ["--max-model-len", "2048", "--kv-cache-memory", "0.25", "--no-playground"]


def _wait_for(predicate, timeout: float, step: float = 0.05) -> float:
    """Seconds until predicate() held; fails the test past the timeout."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"condition not met within {timeout} s")
        time.sleep(step)
    return time.monotonic() - t0


def _health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _long_stream(client: openai.OpenAI, model: str):
    return client.completions.create(model=model, prompt="Once upon a time", max_tokens=1000, stream=True,
                                     extra_body={"ignore_eos": True})


def test_killed_engine_is_restarted_and_counted():
    with real_engine(engine_hang_timeout=5) as engine, background_server(engine) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)
        old_pid = engine.client.proc.pid
        t0 = time.monotonic()
        with pytest.raises(openai.APIError):
            for i, _ in enumerate(_long_stream(c, engine.model_name)):
                if i == 3:
                    os.kill(old_pid, signal.SIGKILL)
        assert time.monotonic() - t0 < 10, "the in-flight stream hung after the engine died"
        # Fresh connections right after the dead engine's sockets close are all answered (a stale selector entry
        # once left such a connection unread: its /health hung until the client gave up).
        for _ in range(10):
            assert httpx.get(srv.url + "/health", timeout=5).status_code in (200, 503)
        # While it restarts, requests get 503 + Retry-After (the openai client would retry them).
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=engine.model_name, prompt="Hello", max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers.get("retry-after")
        elapsed = _wait_for(lambda: _health(srv.url) == 200, timeout=30)
        assert engine.client.proc.pid != old_pid
        r = c.completions.create(model=engine.model_name, prompt="Hello", max_tokens=3)
        assert r.usage.completion_tokens >= 1
        metrics = httpx.get(srv.url + "/metrics").text
        assert "tokenspout:engine_restarts_total" in metrics
        assert any(line.startswith("tokenspout:engine_restarts_total{") and line.endswith(" 1.0")
                   for line in metrics.splitlines()), metrics
        assert engine.get_num_unfinished_requests() == 0
        print(f"serving again {elapsed:.1f} s after the kill")


def test_stopped_engine_is_noticed_by_its_heartbeat_then_replaced():
    hang = 3.0
    with real_engine(engine_hang_timeout=hang) as engine, background_server(engine) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        assert c.completions.create(model=engine.model_name, prompt="Hi", max_tokens=2).usage.completion_tokens
        proc = engine.client.proc
        stream = _long_stream(c, engine.model_name)
        next(iter(stream))
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            t_stop = time.monotonic()
            with pytest.raises(openai.APIError):  # the in-flight stream ends with an error frame
                for _ in stream:
                    pass
            _wait_for(lambda: _health(srv.url) == 503, timeout=hang + 5)
            noticed = time.monotonic() - t_stop
            assert noticed < hang + 2
            assert proc.wait(10) == -signal.SIGKILL  # the stopped process was killed, never resumed
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
        _wait_for(lambda: _health(srv.url) == 200, timeout=30)
        assert c.completions.create(model=engine.model_name, prompt="Hi", max_tokens=2).usage.completion_tokens
        print(f"/health 503 {noticed:.1f} s after SIGSTOP (limit {hang} s)")


def test_idle_frontend_never_mistakes_a_live_engine_for_a_hung_one():
    """Heartbeats queue while nothing reads them: the engine is not declared hung for the frontend's own silence."""
    with real_engine(engine_hang_timeout=2) as engine:
        time.sleep(3)  # no output handler runs yet: heartbeats wait in the socket
        assert not engine.errored and engine.client.proc.poll() is None


# ---- the real `tokenspout serve` process ------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, tmp_path: Path, *flags: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (tmp_path / "serve.log").open("w")
        env = {**os.environ, "TMPDIR": str(tmp_path)}  # its IPC folder lands here, where we can look for it
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenspout.entrypoints.cli", "serve", "--port",
                                      str(self.port), *SERVE_ARGS, *flags], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)
        self.tmp = tmp_path
        try:
            _wait_for(lambda: self.proc.poll() is not None or _health(self.url) == 200, timeout=180, step=0.2)
        except BaseException:
            self.stop()
            raise
        assert self.proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        self.family = [self.proc.pid] + [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]

    def engine_pid(self) -> int:
        kids = [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                if "engine_core_proc" in " ".join(p.cmdline())]
        assert len(kids) == 1, kids
        return kids[0].pid

    def ipc_dirs(self) -> list[Path]:
        return sorted(self.tmp.glob("tokenspout-*"))

    def alive_family(self) -> list[int]:
        return [pid for pid in self.family if psutil.pid_exists(pid) and
                psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]

    def stop(self) -> None:
        """Whatever a failed test left running: the server and its engine."""
        for pid in self.alive_family():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        self.log.close()


def _read_streams(url: str, n: int, frames: list[list[str]], first: threading.Barrier) -> list[threading.Thread]:
    """n raw SSE streams of 1,000 tokens, each thread appending its `data:` payloads to frames[i]."""

    def run(i: int) -> None:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 1000,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                waited = False
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        frames[i].append(line[6:])
                        if not waited:
                            waited = True
                            first.wait(30)
        except httpx.RemoteProtocolError:  # a server told to exit at once (a second SIGTERM) cuts the stream
            frames[i].append("<connection cut>")

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.slow
def test_sigterm_ends_every_stream_with_done_within_the_deadline(tmp_path):
    deadline = 3.0
    srv = Served(tmp_path, "--shutdown-timeout", str(deadline))
    try:
        n = 4
        frames: list[list[str]] = [[] for _ in range(n)]
        first = threading.Barrier(n + 1)
        threads = _read_streams(srv.url, n, frames, first)
        first.wait(60)  # every stream is flowing
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(deadline + 5 + 5)
        exited = time.monotonic() - t0
        for t in threads:
            t.join(10)
        assert exited <= deadline + 5, f"exited {exited:.1f} s after SIGTERM (deadline {deadline} s)"
        for f in frames:
            assert f[-1] == "[DONE]", f[-3:]
            error = json.loads(f[-2])
            assert "shutting down" in error["error"]["message"], error
            assert 1 < len(f) < 1000  # cut at the deadline, not finished
        assert code in (0, -signal.SIGTERM, 128 + signal.SIGTERM), code
        _wait_for(lambda: not srv.alive_family(), timeout=5)
        assert srv.ipc_dirs() == []
        print(f"SIGTERM -> exit in {exited:.1f} s (deadline {deadline} s), {n} streams ended with [DONE]")
    finally:
        srv.stop()


@pytest.mark.slow
def test_second_sigterm_exits_at_once_and_no_engine_restart_exits_nonzero(tmp_path):
    (tmp_path / "a").mkdir()
    srv = Served(tmp_path / "a", "--shutdown-timeout", "60")
    try:
        frames: list[list[str]] = [[]]
        first = threading.Barrier(2)
        _read_streams(srv.url, 1, frames, first)
        first.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert srv.proc.poll() is None  # draining: the stream may go on for 60 s
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(10)
        assert time.monotonic() - t0 < 3
        _wait_for(lambda: not srv.alive_family(), timeout=5)
        assert srv.ipc_dirs() == []
    finally:
        srv.stop()
    (tmp_path / "b").mkdir()
    srv = Served(tmp_path / "b", "--no-engine-restart")
    try:
        os.kill(srv.engine_pid(), signal.SIGKILL)
        code = srv.proc.wait(30)
        assert code == 1, code
        _wait_for(lambda: not srv.alive_family(), timeout=5)
        assert srv.ipc_dirs() == []
    finally:
        srv.stop()


@pytest.mark.slow
def test_sigterm_with_a_stopped_engine_exits_within_the_deadline(tmp_path):
    """An engine frozen (SIGSTOP) before the hang limit noticed it: shutdown kills it at once instead of waiting 5 s
    for an answer to its request to stop and 5 s for a SIGTERM that a stopped process keeps pending."""
    deadline = 2.0
    srv = Served(tmp_path, "--shutdown-timeout", str(deadline))
    try:
        engine = srv.engine_pid()
        os.kill(engine, signal.SIGSTOP)
        time.sleep(4)  # past three heartbeats (the hang limit, 30 s, is far off)
        assert _health(srv.url) == 200
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(deadline + 15)
        exited = time.monotonic() - t0
        assert exited <= deadline + 2, f"exited {exited:.1f} s after SIGTERM (deadline {deadline} s)"
        _wait_for(lambda: not srv.alive_family(), timeout=5)
        assert srv.ipc_dirs() == []
        print(f"SIGTERM with a stopped engine -> exit in {exited:.1f} s")
    finally:
        srv.stop()


@pytest.mark.slow
def test_engine_of_a_killed_server_exits_and_removes_its_ipc_folder(tmp_path):
    srv = Served(tmp_path)
    try:
        engine = psutil.Process(srv.engine_pid())
        assert len(srv.ipc_dirs()) == 1
        srv.proc.kill()
        srv.proc.wait(10)
        engine.wait(10)  # it polls its parent twice a second
        assert srv.ipc_dirs() == []
    finally:
        srv.stop()
