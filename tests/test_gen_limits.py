"""Where generation stops (issue 34, ``models.gen_limits``): the EOS ids of ``generation_config.json`` (an int or a
list, as Qwen3 and Llama-3 ship them) end FullLoad and offloaded generation at the same token, through every loop
(``generate_ids``, the CLI, continuous batching, the server); and every loop stops at the model's position limit
(``max_position_embeddings``) with finish reason "length", a prompt beyond it being refused in one line.

The EOS checkpoints are the tiny Qwen3-MoE with a ``generation_config.json`` whose list names an id the greedy
FullLoad run makes at position ``STOP`` (and an id it never makes), while ``config.json`` names another id."""

import json
import shutil
import types

import pytest
import torch

from moe_offload.generation.batching import generate_batch_ids
from moe_offload.cli import main
from moe_offload.errors import MoeOffloadError
from moe_offload.generation.generate import eos_ids, encode_prompt, generate_ids
from moe_offload.models.gen_limits import eos_token_ids, new_token_budget, position_limit
from moe_offload.models.loader import load_full, load_offloaded

PROMPTS = ["Hello there, how are you today?", "The slot pool is shared by all MoE layers."]
NEW = 30
STOP = 5  # the EOS id of the list is the token FullLoad makes here (or at the first later position it is new)
LIMIT = 64  # max_position_embeddings of the small-limit checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def _edit_json(path, **changes):
    d = json.loads(path.read_text())
    d.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        del d[k]
    path.write_text(json.dumps(d))


@pytest.fixture(scope="module")
def eos_ckpt(tiny_dirs, tmp_path_factory):
    """``(dir, stop_id, references)``: the tiny Qwen3-MoE whose ``generation_config.json`` lists ``[never, stop_id]``
    (``stop_id``: the first token of the greedy run of ``PROMPTS[0]`` at or after ``STOP`` not made before; ``never``:
    an id neither prompt's run makes) and whose ``config.json`` names a third id; ``references``: each prompt's 30
    greedy tokens from the unmodified checkpoint."""
    src = tiny_dirs["qwen3_moe"]
    full = load_full(src, device="cpu")
    refs = [generate_ids(full, encode_prompt(full.tokenizer, p), NEW)[0] for p in PROMPTS]
    assert not set(eos_ids(full)) & set(refs[0] + refs[1])  # the unmodified model runs to NEW tokens
    pos = next(i for i in range(STOP, NEW) if refs[0][i] not in refs[0][:i])
    made = set(refs[0] + refs[1])
    never, other = [t for t in range(256) if t not in made][:2]
    d = tmp_path_factory.mktemp("eos") / "qwen3_moe"
    shutil.copytree(src, d)
    _edit_json(d / "generation_config.json", eos_token_id=[never, refs[0][pos]], _from_model_config=None)
    _edit_json(d / "config.json", eos_token_id=other)
    return d, refs[0][pos], refs


def test_eos_ids_resolution():
    """The generation config's int or list wins over the model config's; the tokenizer's is added."""
    tok = types.SimpleNamespace(eos_token_id=9)
    cfg = types.SimpleNamespace(eos_token_id=3)
    assert eos_token_ids(types.SimpleNamespace(eos_token_id=[5, 7]), cfg, tok) == {5, 7, 9}
    assert eos_token_ids(types.SimpleNamespace(eos_token_id=5), cfg, None) == {5}
    assert eos_token_ids(types.SimpleNamespace(eos_token_id=None), cfg, tok) == {3, 9}
    assert eos_token_ids(None, None, None) == frozenset()


def test_generation_config_list_stops_full_and_offloaded(eos_ckpt):
    d, stop_id, refs = eos_ckpt
    full = load_full(d, device="cpu")
    off = load_offloaded(d, device="cpu", residency=0.5, progress=False)
    assert stop_id in eos_ids(off) and eos_ids(off) == eos_ids(full)
    assert off.model.generation_config.eos_token_id == full.model.generation_config.eos_token_id
    ids = encode_prompt(full.tokenizer, PROMPTS[0])
    want = refs[0][:refs[0].index(stop_id) + 1]
    assert STOP < len(want) < NEW
    assert generate_ids(full, ids, NEW)[0] == want
    assert generate_ids(off, ids, NEW)[0] == want


def _cli_json(capsys, *args) -> dict:
    capsys.readouterr()
    assert main(["generate", "--device", "cpu", "--quiet", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_generation_config_list_stops_cli(eos_ckpt, capsys):
    d, stop_id, refs = eos_ckpt
    want = refs[0][:refs[0].index(stop_id) + 1]
    common = ["--model", str(d), "--prompt", PROMPTS[0], "--max-new-tokens", str(NEW)]
    for size in (["--full-load"], ["--residency", "0.5"]):
        out = _cli_json(capsys, *common, *size)["outputs"][0]
        assert out["token_ids"] == want
        assert out["finish_reason"] == "stop" and out["position_limit"] is None


def test_generation_config_list_stops_batched(eos_ckpt):
    """Continuous batching (two rows): the row that makes the listed id stops there, the other runs on."""
    d, stop_id, refs = eos_ckpt
    off = load_offloaded(d, device="cpu", residency=0.5, progress=False)
    prompts = [encode_prompt(off.tokenizer, p) for p in PROMPTS]
    seqs = generate_batch_ids(off, prompts, NEW, 2)
    assert seqs[0].new == refs[0][:refs[0].index(stop_id) + 1]
    assert seqs[1].new == refs[1]


def test_generation_config_list_stops_server(eos_ckpt):
    """The server's queued worker and its batch worker stop at the listed id with finish reason "stop"."""
    import urllib.request

    from moe_offload.serve.server import ServeConfig, ServerThread, load_for_serving

    d, stop_id, refs = eos_ckpt
    want = refs[0][:refs[0].index(stop_id) + 1]
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": NEW,
                       "return_token_ids": True}).encode()
    for max_batch in (1, 2):
        state = load_for_serving(ServeConfig(d, model_name="m", residency=0.5, device="cpu", max_batch=max_batch),
                                 log=lambda m: None)
        with ServerThread(state) as srv:
            req = urllib.request.Request(srv.base_url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req) as r:
                choice = json.loads(r.read())["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["token_ids"] == want


# -- the position limit ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limit_ckpt(tiny_dirs, tmp_path_factory):
    """``(dir, references)``: the tiny Qwen3-MoE with ``max_position_embeddings`` ``LIMIT`` (rotary frequencies do not
    depend on it: its tokens are the unmodified checkpoint's) and no EOS the runs make; ``references``: each prompt's
    greedy tokens up to the limit from the unmodified checkpoint."""
    src = tiny_dirs["qwen3_moe"]
    full = load_full(src, device="cpu")
    ids = [encode_prompt(full.tokenizer, p) for p in PROMPTS]
    refs = [generate_ids(full, i, LIMIT - len(i))[0] for i in ids]
    assert all(len(r) == LIMIT - len(i) for r, i in zip(refs, ids))  # no EOS before the limit
    d = tmp_path_factory.mktemp("limit") / "qwen3_moe"
    shutil.copytree(src, d)
    _edit_json(d / "config.json", max_position_embeddings=LIMIT)
    return d, refs


def test_new_token_budget():
    assert new_token_budget(None, 10, 100) == 100
    assert new_token_budget(40, 10, 100) == 30
    assert new_token_budget(40, 10, 5) == 5
    assert new_token_budget(40, 10, 100, block_length=8) == 30  # whole blocks: 5 of 8 positions
    assert new_token_budget(46, 10, 100, block_length=8) == 30  # still 5 blocks: 40 positions
    for prompt in (40, 41):
        with pytest.raises(MoeOffloadError, match="position limit of 40"):
            new_token_budget(40, prompt, 1)
    assert position_limit(types.SimpleNamespace(max_position_embeddings=40)) == 40


def test_position_limit_stops_every_loop(limit_ckpt):
    d, refs = limit_ckpt
    off = load_offloaded(d, device="cpu", residency=0.5, progress=False)
    full = load_full(d, device="cpu")
    assert off.max_positions == full.max_positions == LIMIT
    ids = [encode_prompt(off.tokenizer, p) for p in PROMPTS]
    for lm in (full, off):
        assert [generate_ids(lm, i, 1000)[0] for i in ids] == refs
    seqs = generate_batch_ids(off, ids, 1000, 2)
    assert [s.new for s in seqs] == refs
    with pytest.raises(MoeOffloadError, match=f"position limit of {LIMIT}"):
        generate_ids(off, list(range(LIMIT)), 1)
    with pytest.raises(MoeOffloadError, match=f"position limit of {LIMIT}"):
        generate_batch_ids(off, [ids[0], list(range(LIMIT + 3))], 10, 2)


def test_position_limit_cli(limit_ckpt, capsys):
    d, refs = limit_ckpt
    common = ["--model", str(d), "--prompt", PROMPTS[0], "--max-new-tokens", "576"]
    for size in (["--full-load"], ["--residency", "0.5"]):
        out = _cli_json(capsys, *common, *size)["outputs"][0]
        assert out["token_ids"] == refs[0]
        assert out["finish_reason"] == "length" and out["position_limit"] == LIMIT
    assert main(["generate", "--device", "cpu", "--quiet", *common, "--residency", "0.5"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "position limit" in ln]
    assert lines == [f"request 0: stopped at the model's position limit of {LIMIT} tokens "
                     f"({LIMIT - len(refs[0])} in the prompt + {len(refs[0])} new, of --max-new-tokens 576); "
                     "finish reason: length"]
    assert main(["generate", "--device", "cpu", "--quiet", "--model", str(d), "--prompt", "x" * 70]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "position limit of 64" in err[0] and err[0].startswith("moe-offload: error:")


def test_position_limit_stops_diffusion(tmp_path):
    """Block diffusion uses whole blocks within the limit: 20 positions, blocks of 8 -> 16 positions."""
    from test_diffusion import fake_lm

    from moe_offload.generation.diffusion import diffusion_generate_ids

    lm = fake_lm(tmp_path)
    lm.max_positions = 20
    res = diffusion_generate_ids(lm, [1, 2, 3], 100, block_length=8, steps=8)
    assert len(res.token_ids) == 16 - 3
    with pytest.raises(MoeOffloadError, match="position limit of 20"):
        diffusion_generate_ids(lm, list(range(16)), 4, block_length=8, steps=8)


def test_graph_decode_stops_at_eos_list_and_position_limit(eos_ckpt, limit_ckpt):
    """Graph mode (aot_eager, the eager kernels) shares the EOS ids and the position limit."""
    from moe_offload.graph.decode import GraphDecoder, load_graph

    d, stop_id, refs = eos_ckpt
    lm = load_graph(d, policy="lru", residency=0.5, device="cpu")
    ids = encode_prompt(lm.tokenizer, PROMPTS[0])
    assert GraphDecoder(lm, backend="aot_eager").generate_ids(ids, NEW)[0] == refs[0][:refs[0].index(stop_id) + 1]
    d, refs = limit_ckpt
    lm = load_graph(d, policy="lru", residency=0.5, device="cpu")
    assert GraphDecoder(lm, backend="aot_eager").generate_ids(ids, 1000)[0] == refs[0]
