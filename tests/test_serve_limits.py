"""What the server refuses for its own sake (``serve.limits``): a body above ``--max-request-mb`` (413) and a
request that finds the queue full (503 on the OpenAI side, 529 ``overloaded_error`` on Anthropic's, with
``Retry-After``), each raised by the official clients as their own exception classes; the server goes on."""

import http.client
import json
import threading
import time

import anthropic
import openai
import pytest

import moe_offload.serve.worker as worker_mod
from moe_offload.serve.server import ServeConfig, ServerThread, load_for_serving

MODEL = "tiny-qwen"
LIMIT = 4000  # bytes


@pytest.fixture(scope="module")
def srv(tiny_dirs):
    state = load_for_serving(ServeConfig(tiny_dirs["qwen3_moe"], model_name=MODEL, max_context=256, max_batch=1,
                                         max_queue=1, max_request_bytes=LIMIT), log=lambda m: None)
    with ServerThread(state) as server:
        ac = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)
        oc = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        yield state, server, ac, oc
        ac.close()
        oc.close()


def test_a_body_above_the_limit_is_413_in_each_apis_shape(srv):
    state, server, ac, oc = srv
    big = "x" * (LIMIT + 10)
    with pytest.raises(anthropic.ContentTooLargeError) as e:
        ac.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": big}])
    assert e.value.body["error"]["type"] == "request_too_large" and "at most 4,000" in e.value.body["error"]["message"]
    with pytest.raises(openai.APIStatusError) as e:
        oc.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": big}])
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"
    # a chunked body (no Content-Length) is counted as it is read
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    body = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": big}]}).encode()
    conn.putrequest("POST", "/v1/messages")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    for i in range(0, len(body), 1000):
        piece = body[i:i + 1000]
        conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
    conn.send(b"0\r\n\r\n")
    r = conn.getresponse()
    err = json.loads(r.read())
    assert r.status == 413, err
    assert err["type"] == "error" and err["error"]["type"] == "request_too_large"
    conn.close()
    ok = ac.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert ok.usage.output_tokens >= 1


def test_a_full_queue_is_overloaded_with_retry_after(srv, monkeypatch):
    """One request running (held), one waiting (``--max-queue 1``): the next gets 529 / 503 with Retry-After; when
    the first is released, both finish."""
    state, server, ac, oc = srv
    release = threading.Event()
    real = worker_mod.generate_ids

    def held(*a, **kw):
        release.wait(30)
        return real(*a, **kw)

    monkeypatch.setattr(worker_mod, "generate_ids", held)
    results = []
    msgs = [{"role": "user", "content": "Hi"}]
    threads = [threading.Thread(target=lambda: results.append(
        ac.messages.create(model=MODEL, max_tokens=2, messages=msgs))) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while state.worker.queue_length < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        with pytest.raises(anthropic.OverloadedError) as e:
            ac.messages.create(model=MODEL, max_tokens=2, messages=msgs)
        assert e.value.status_code == 529 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["error"]["type"] == "overloaded_error"
        with pytest.raises(openai.InternalServerError) as e:
            oc.chat.completions.create(model=MODEL, max_tokens=2, messages=msgs)
        assert e.value.status_code == 503 and e.value.body["code"] == "server_overloaded"
        assert e.value.response.headers["retry-after"] == "1"
    finally:
        release.set()
        for t in threads:
            t.join(60)
    assert len(results) == 2 and all(m.usage.output_tokens >= 1 for m in results)
