"""``serve --graph`` (``serve.graph_serving``): the decode step compiled once at start, the requests decoded by it
with FullLoad's tokens, streamed as the eager server streams them; what it does not serve is a one-line error."""

from __future__ import annotations

import openai
import pytest
import torch

from moe_offload.cli import main
from moe_offload.generation.generate import encode_prompt, generate_ids
from moe_offload.models.loader import load_full
from moe_offload.serve.server import ServeConfig, ServerThread, load_for_serving

PROMPT = "Hello there, how are you today?"


@pytest.fixture(scope="module")
def served(tiny_dirs):
    """A tiny Qwen3-MoE served with --graph (aot_eager: the eager kernels, FullLoad's tokens bit for bit at one
    thread) at residency 0.5, its FullLoad reference, a client and the start-up log."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    d, log = tiny_dirs["qwen3_moe"], []
    state = load_for_serving(ServeConfig(d, model_name="g", max_context=256, residency=0.5, graph=True,
                                         graph_backend="aot_eager"), log=log.append)
    with ServerThread(state) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        yield state, client, load_full(d, device="cpu"), log
        client.close()
    torch.set_num_threads(threads)


def test_compiled_at_start_and_equal_to_full_load(served):
    state, client, ref, log = served
    compiled_at = next(i for i, m in enumerate(log) if "decode step compiled in" in m)
    assert any(m.startswith("ready in") for m in log[compiled_at:])  # "ready" only once the step is compiled
    dec = state.worker.graph_decoder
    compiled = dec.compile_s
    assert compiled > 0 and state.plan.batch == 1
    want = generate_ids(ref, encode_prompt(ref.tokenizer, PROMPT), 12)[0]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(2):
        r = client.chat.completions.create(model="g", messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
                                           temperature=0, extra_body={"return_token_ids": True})
        assert r.choices[0].token_ids == want
    assert dec.compile_s == compiled  # no request compiled: one static cache of --max-context for all
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # not even the first (no recompile)
    chunks = list(client.chat.completions.create(model="g", messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=12, temperature=0, stream=True,
                                                 extra_body={"return_token_ids": True}))
    assert [t for ch in chunks if ch.choices for t in (getattr(ch.choices[0], "token_ids", None) or [])] == want
    stats = state.lm.engine.stats
    assert stats.hits + stats.misses > 0 and stats.misses > 0  # offloaded at 0.5: the graph engine's counters
    assert state.stats()["graph"] == {"backend": "aot_eager", "compile_s": round(compiled, 3),
                                      "static_cache_positions": 256}


@pytest.mark.parametrize("extra, needle", [
    (("--max-batch", "4"), "decodes one request at a time"),
    (("--memory-budget", "1"), "not --memory-budget"),
    (("--host-store", "disk"), "--host-store pinned"),
])
def test_graph_refusals_are_one_line(tiny_dirs, capsys, extra, needle):
    code = main(["serve", "--model", str(tiny_dirs["qwen3_moe"]), "--graph", "--quiet", "--port", "0", *extra])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("moe-offload: error: ") and needle in err[0], err
