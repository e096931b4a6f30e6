"""Replicas on Ray Serve (``moe_offload.serve.replicas``, issue 18): two CPU replicas of the tiny Qwen3-MoE behind
one OpenAI-compatible endpoint answer 64 concurrent streaming requests through the official ``openai`` client
with 0 errors, each request's tokens equal ``generate_ids`` alone, and Ray reports both replicas healthy.

Skipped when Ray Serve is not installed (``pip install 'moe-offload[replicas]'``); marked slow (a Ray instance
starts: about a minute on 2 cores)."""

import asyncio
import socket
import urllib.request

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from moe_offload.errors import MoeOffloadError  # noqa: E402
from moe_offload.generation.generate import generate_ids  # noqa: E402
from moe_offload.models.loader import load_offloaded  # noqa: E402
from moe_offload.serve.replicas import application, build, start_replicas, stop_replicas  # noqa: E402
from moe_offload.serve.server import ServeConfig  # noqa: E402

pytestmark = pytest.mark.slow
CONTEXT = 64
NEW = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _requests(base_url, prompts):
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300) as c:
        async def one(p):
            ids = []
            stream = await c.completions.create(model="tiny", prompt=p, max_tokens=NEW, temperature=0, stream=True,
                                                extra_body={"return_token_ids": True})
            async for ch in stream:
                for choice in ch.choices:
                    ids += getattr(choice, "token_ids", None) or []
            return ids
        return await asyncio.gather(*[one(p) for p in prompts], return_exceptions=True)


def test_two_replicas_answer_64_concurrent_requests(tiny_dirs):
    from ray import serve

    d = tiny_dirs["qwen3_moe"]
    cfg = ServeConfig(d, model_name="tiny", residency=0.5, max_context=CONTEXT, max_batch=8, progress=False)
    port = _free_port()
    start_replicas(cfg, 2, "127.0.0.1", port, num_cpus=2)
    try:
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(base + "/v1/models") as r:
            assert b"tiny" in r.read()
        prompts = [f"request {i}: " + "word " * (i % 7) for i in range(64)]
        got = asyncio.run(_requests(base, prompts))
        status = serve.status().applications["moe-offload"]
        dep = status.deployments["moe-offload"]
        replicas = dep.replica_states
    finally:
        stop_replicas()
    errors = [g for g in got if isinstance(g, BaseException)]
    assert errors == []
    ref = load_offloaded(d, residency=0.5, device="cpu", progress=False)
    tok = ref.tokenizer
    assert got == [generate_ids(ref, tok(p)["input_ids"], NEW)[0] for p in prompts]
    assert replicas.get("RUNNING") == 2 and str(status.status).endswith("RUNNING")


def test_bad_replica_options_say_so(tiny_dirs):
    with pytest.raises(MoeOffloadError, match="at least 1"):
        application(ServeConfig(tiny_dirs["qwen3_moe"]), 0)
    with pytest.raises(MoeOffloadError, match="unknown option 'bogus'"):
        build({"model": str(tiny_dirs["qwen3_moe"]), "bogus": "1"})
