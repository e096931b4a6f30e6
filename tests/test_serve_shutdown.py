"""``moe-offload serve`` at shutdown and its log (issue 15): queued and running requests end with an OpenAI-style
JSON error (503) or their stream's final event, never uvicorn's plain-text 500; every log line goes to stderr."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import moe_offload.serve.worker as worker_mod
from moe_offload.serve.server import ServeConfig, ServerThread, load_for_serving, log_config

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _post(url: str, body: dict, result: dict, key: str) -> None:
    """POST ``body`` as JSON; store ``(status, content type, raw body)`` under ``result[key]``."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            result[key] = (r.status, r.headers.get("Content-Type", ""), r.read().decode())
    except urllib.error.HTTPError as e:
        result[key] = (e.code, e.headers.get("Content-Type", ""), e.read().decode())


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_shutdown_ends_queued_and_running_requests_with_json_errors(tiny_dirs, monkeypatch):
    state = load_for_serving(ServeConfig(tiny_dirs["qwen3_moe"], model_name="tiny", max_context=256, max_batch=1),
                             log=lambda m: None)
    started, release = threading.Event(), threading.Event()
    real = worker_mod.generate_ids

    def held(*a, on_token=None, **kw):  # the running request waits at its first token until the test lets it go
        def hook(t):
            started.set()
            release.wait(30)
            return on_token(t)
        return real(*a, on_token=hook, **kw)

    monkeypatch.setattr(worker_mod, "generate_ids", held)
    msgs = [{"role": "user", "content": "hi"}]
    results: dict = {}
    with ServerThread(state) as srv:
        srv.server.grace_s = 0.0  # the running request is stopped at once (after its current token)
        url = srv.base_url + "/v1/chat/completions"
        threads = [threading.Thread(target=_post, args=(url, dict(model="tiny", messages=msgs, max_tokens=200,
                                                                   stream=True), results, "running"))]
        threads[0].start()
        assert started.wait(30)
        for key, stream in (("queued", False), ("queued_stream", True)):
            threads.append(threading.Thread(target=_post, args=(url, dict(model="tiny", messages=msgs, max_tokens=5,
                                                                           stream=stream), results, key)))
            threads[-1].start()
        _wait(lambda: state.worker.queue_length == 2, "two queued requests")
        srv.server.begin_shutdown()
        _wait(lambda: state.worker.active is None or state.worker.active.shutdown, "the running request's stop")
        release.set()
        for t in threads:
            t.join(60)
    status, ctype, body = results["queued"]
    assert status == 503 and ctype.startswith("application/json")
    err = json.loads(body)["error"]
    assert err["type"] == "server_error" and err["code"] == "server_shutting_down" and "shutting down" in err["message"]
    for key in ("queued_stream", "running"):  # streams: the error is their final event, then [DONE]
        status, ctype, body = results[key]
        events = [ln[len("data: "):] for ln in body.splitlines() if ln.startswith("data: ")]
        assert status == 200 and ctype.startswith("text/event-stream") and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    assert state.worker.stats.requests_failed == 0


def test_log_config_puts_every_logger_on_stderr():
    cfg = log_config()
    assert {h["stream"] for h in cfg["handlers"].values()} == {"ext://sys.stderr"}
    assert all(f["fmt"].startswith("moe-offload serve: ") for f in cfg["formatters"].values())


class _StderrLines:
    """Every line of ``proc.stderr``, read on a thread into a queue: a ``select`` on the pipe misses lines that an
    earlier ``readline`` already pulled into the text wrapper's buffer (two log lines written together)."""

    def __init__(self, proc):
        self.lines: "queue.Queue[str | None]" = queue.Queue()
        self.seen = ""
        self.thread = threading.Thread(target=self._pump, args=(proc.stderr,), daemon=True)
        self.thread.start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)  # end of stream

    def read_until(self, needle: str, timeout: float = 120.0) -> str:
        """Lines up to and including the first one holding ``needle``; AssertionError after ``timeout`` seconds or at
        the end of the stream."""
        start, deadline = len(self.seen), time.monotonic() + timeout
        while needle not in self.seen[start:]:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(f"server did not print {needle!r}; stderr so far:\n{self.seen}")
            self.seen += line
        return self.seen[start:]

    def wait_end(self, timeout: float = 60.0) -> None:
        """Wait for the end of the stream; ``seen`` then holds every line."""
        self.thread.join(timeout)
        while not self.lines.empty():
            self.seen += self.lines.get() or ""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_serve_logs_to_one_stream_and_exits_cleanly_on_sigterm(tiny_dirs):
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "moe_offload.cli", "serve", "--model", str(tiny_dirs["qwen3_moe"]),
                             "--port", "0", "--max-context", "128", "--quiet"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = _StderrLines(proc)
        head = lines.read_until("listening on http://")  # printed once the socket accepts connections
        base = head.split("listening on ")[1].split()[0]
        with urllib.request.urlopen(base + "/health", timeout=30) as r:
            assert json.loads(r.read())["status"] == "ok"
        lines.read_until("GET /health")  # the access log line arrives on stderr
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        lines.wait_end()
        out, err = proc.stdout.read(), lines.seen[len(head):]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # uvicorn re-raises the captured SIGTERM once it has shut down, so the exit status says what stopped it
    assert proc.returncode in (0, -signal.SIGTERM), err
    assert out == ""
    assert "Application shutdown complete" in err and "Traceback" not in err
    assert all(ln.startswith("moe-offload serve: ") for ln in (head + err).splitlines() if ln.strip())
