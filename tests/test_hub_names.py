"""``--model ORG/NAME[@REVISION]`` (issue 37): Hub names resolved through huggingface_hub, all offline.

A Hugging Face hub cache is laid out in a temporary directory exactly as huggingface_hub writes it
(``models--org--name/{blobs,snapshots/<commit>,refs}``, snapshot files as relative symlinks to blobs named by their
etag) and checked with huggingface_hub's own readers (``scan_cache_dir``, ``snapshot_download(local_files_only=True)``)
before use; ``HF_HUB_CACHE`` points at it and ``HF_HUB_OFFLINE=1``.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_offload.cli import main
from moe_offload.errors import MoeOffloadError

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
GEN = ["--prompt", "hello there", "--max-new-tokens", "6", "--json", "--quiet", "--device", "cpu"]


def _etag(data: bytes, lfs: bool) -> str:
    """The blob name huggingface_hub gives a file: the sha256 of an LFS file, else the git blob sha1."""
    if lfs:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def cache_repo(cache: Path, repo_id: str, commit: str, files: dict[str, Path], refs: tuple[str, ...] = ("main",)):
    """Lay out ``files`` (``{repo path: source file}``) as the snapshot ``commit`` of ``repo_id`` in the hub cache
    ``cache``, the way ``hf_hub_download`` stores them, with ``refs`` pointing at ``commit``."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / commit
    for rel, src in files.items():
        data = src.read_bytes()
        blob = repo / "blobs" / _etag(data, lfs=rel.endswith((".safetensors", ".bin")))
        blob.write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # huggingface_hub writes the hash without a newline
    return snap


def checkpoint_files(ckpt: Path, only: tuple[str, ...] | None = None) -> dict[str, Path]:
    """``{name: path}`` of the files of a checkpoint directory (or ``only`` these)."""
    return {p.name: p for p in sorted(ckpt.iterdir()) if p.is_file() and (only is None or p.name in only)}


@pytest.fixture(scope="module")
def tiny_b(tmp_path_factory):
    """A second tiny qwen3_moe checkpoint (seed 2: other weights, so other tokens, six before any end of text)."""
    from moe_offload.models.tiny import make_tiny

    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny_b") / "ckpt", seed=2)


@pytest.fixture
def hub(tmp_path, tiny_dirs, tiny_b, monkeypatch):
    """An offline hub cache: ``org/tiny`` at COMMIT_A (tag v1; the tiny qwen3_moe) and COMMIT_B (main; ``tiny_b``),
    ``org/config-only`` (config.json alone), ``org/pickled`` (config, tokenizer, pytorch_model.bin)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    ckpt = tiny_dirs["qwen3_moe"]
    cache_repo(cache, "org/tiny", COMMIT_A, checkpoint_files(ckpt), refs=("v1",))
    cache_repo(cache, "org/tiny", COMMIT_B, checkpoint_files(tiny_b))
    cache_repo(cache, "org/config-only", COMMIT_A, checkpoint_files(ckpt, ("config.json",)))
    pickled = checkpoint_files(ckpt, ("config.json", "tokenizer.json", "tokenizer_config.json"))
    pickle_file = tmp_path / "pytorch_model.bin"
    pickle_file.write_bytes(b"PK\x03\x04 not read")
    cache_repo(cache, "org/pickled", COMMIT_A, {**pickled, "pytorch_model.bin": pickle_file})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return cache


def test_the_cache_is_huggingface_hubs_layout(hub):
    """huggingface_hub's own readers accept the cache: no corrupted repository, the refs resolve, the files load."""
    from huggingface_hub import scan_cache_dir, snapshot_download, try_to_load_from_cache

    info = scan_cache_dir(hub)
    assert info.warnings == []
    repos = {r.repo_id: r for r in info.repos}
    assert sorted(repos) == ["org/config-only", "org/pickled", "org/tiny"]
    assert {rev.commit_hash: set(rev.refs) for rev in repos["org/tiny"].revisions} == {COMMIT_A: {"v1"},
                                                                                        COMMIT_B: {"main"}}
    assert snapshot_download("org/tiny", local_files_only=True) == str(hub / "models--org--tiny/snapshots" / COMMIT_B)
    assert snapshot_download("org/tiny", revision="v1", local_files_only=True).endswith(COMMIT_A)
    assert try_to_load_from_cache("org/tiny", "config.json") == str(hub / "models--org--tiny/snapshots" / COMMIT_B
                                                                     / "config.json")


def _tokens(capsys, model: str) -> list:
    assert main(["generate", "--model", model, *GEN]) == 0
    return [o["token_ids"] for o in json.loads(capsys.readouterr().out)["outputs"]]


def test_generate_from_a_hub_name_matches_the_directory(capsys, hub, tiny_dirs, tiny_b):
    """(a) ``org/tiny`` (main: COMMIT_B) generates the tokens of the directory it was cached from."""
    from_dir = _tokens(capsys, str(tiny_b))
    assert from_dir and len(from_dir[0]) == 6
    assert _tokens(capsys, "org/tiny") == from_dir
    assert _tokens(capsys, str(tiny_dirs["qwen3_moe"])) != from_dir  # the two commits differ


@pytest.mark.parametrize("revision", [COMMIT_A, "v1"])
def test_a_revision_is_pinned(capsys, hub, tiny_dirs, revision):
    """(b) ``@COMMIT`` and ``@TAG`` give that snapshot, not main."""
    from moe_offload.testbed.resolve import resolve_model

    assert resolve_model(f"org/tiny@{revision}", progress=False) == hub / "models--org--tiny/snapshots" / COMMIT_A
    assert _tokens(capsys, f"org/tiny@{revision}") == _tokens(capsys, str(tiny_dirs["qwen3_moe"]))


def _one_line(capsys, argv) -> str:
    code = main(argv)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("moe-offload: error: "), lines
    return lines[0]


@pytest.mark.parametrize("model", ["org/absent", "org/tiny@no-such-branch", f"org/tiny@{'c' * 40}"])
def test_offline_and_not_cached_names_the_cache_fast(capsys, hub, model):
    """(c) one line naming the cache directory, in under 2 s (no network, no retries)."""
    start = time.perf_counter()
    line = _one_line(capsys, ["generate", "--model", model, *GEN])
    assert time.perf_counter() - start < 2.0
    assert line == (f"moe-offload: error: {model} is not in the Hugging Face cache {hub} and HF_HUB_OFFLINE=1 forbids "
                    "downloading it: download it once without HF_HUB_OFFLINE, or set HF_HUB_CACHE to the cache that "
                    "holds it")


def test_offline_and_not_cached_in_a_fresh_process(tmp_path):
    """(c) with the environment variables themselves (read when huggingface_hub is imported), via the CLI entry."""
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "empty-cache"), "HF_HUB_OFFLINE": "1"}
    # the modules the command uses are imported before the clock starts (the CLI imports them lazily): the time
    # measured is the failure's, which must not wait for network retries
    code = ("import sys, time; from moe_offload.cli import main; import moe_offload.architectures.supported, "
            "moe_offload.models.hub; "
            "t = time.perf_counter(); c = main(['models', '--config', 'org/absent']); print(c, time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    status, seconds = out.stdout.split()
    assert status == "2" and float(seconds) < 2.0
    assert out.stderr.strip() == (f"moe-offload: error: org/absent is not in the Hugging Face cache "
                                  f"{tmp_path / 'empty-cache'} and HF_HUB_OFFLINE=1 forbids downloading it: "
                                  "download it once without HF_HUB_OFFLINE, or set HF_HUB_CACHE to the cache that "
                                  "holds it")


def test_pickle_only_repository(capsys, hub):
    """(d) a cached repository with pytorch_model.bin and no safetensors: pickle checkpoints are not read."""
    line = _one_line(capsys, ["generate", "--model", "org/pickled", *GEN])
    assert line == ("moe-offload: error: org/pickled has no *.safetensors weights (it holds pytorch_model.bin); "
                    "moe-offload reads safetensors only (pickle checkpoints such as pytorch_model.bin are not read)")


def test_models_config_reads_config_json_alone(capsys, hub, tiny_dirs):
    """(e) ``models --config ORG/NAME`` from a cache holding config.json only: the same report as the directory's."""
    assert main(["models", "--config", str(tiny_dirs["qwen3_moe"])]) == 0
    expected = capsys.readouterr().out
    assert expected.startswith("qwen3_moe (") and "routed experts" in expected
    assert main(["models", "--config", "org/config-only"]) == 0
    assert capsys.readouterr().out == expected
    line = _one_line(capsys, ["generate", "--model", "org/config-only", *GEN])  # no weights: not servable
    assert line.startswith("moe-offload: error: org/config-only has no *.safetensors weights;")


def test_a_local_directory_named_like_a_hub_name_wins(capsys, hub, tiny_dirs, tiny_b):
    """(f) ``org/tiny`` as a directory relative to the working directory is used instead of the cache (which holds
    other weights under that name)."""
    from moe_offload.testbed.resolve import resolve_model

    local = Path("org/tiny")
    shutil.copytree(tiny_dirs["qwen3_moe"], local)
    assert resolve_model("org/tiny", progress=False) == local
    assert _tokens(capsys, "org/tiny") == _tokens(capsys, str(tiny_dirs["qwen3_moe"]))
    assert _tokens(capsys, "org/tiny") != _tokens(capsys, str(tiny_b))


@pytest.mark.parametrize("name, problem", [
    ("org/na me", "Repo id must use alphanumeric chars"),
    ("org/tiny@", "the revision after @ is empty"),
    ("/org", None),  # a path: not a Hub name
    ("org/", "the organization and the model name must both be given"),
    ("org/a--b", "Cannot have -- or .. in repo_id"),
])
def test_malformed_names(capsys, hub, name, problem):
    line = _one_line(capsys, ["generate", "--model", name, *GEN])
    if problem is None:
        assert line.startswith(f"moe-offload: error: model directory not found: {name};")
    else:
        assert line.startswith(f"moe-offload: error: malformed Hugging Face model name {name!r} ({problem}")
        assert line.endswith("give ORG/NAME[@REVISION] (letters, digits, '-', '_', '.'), or an existing checkpoint "
                             "directory")


def test_hub_exceptions_are_one_line_messages(hub, monkeypatch):
    """Each huggingface_hub exception the Hub raises online maps to its message (raised here by a stand-in for
    snapshot_download, since the tests have no network)."""
    import httpx2 as httpx
    import huggingface_hub
    from huggingface_hub import errors

    from moe_offload.models import hub as hubmod

    response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api/models/org/x"))
    cases = {
        errors.GatedRepoError("gated", response=response):
            "org/x is a gated repository: accept its conditions on https://huggingface.co/org/x and set HF_TOKEN to "
            "an access token (or run `hf auth login`)",
        errors.RepositoryNotFoundError("404", response=response):
            "no model repository org/x on the Hugging Face Hub (or it is private and HF_TOKEN is not set); give "
            "ORG/NAME[@REVISION] or a checkpoint directory",
        errors.RevisionNotFoundError("404", response=response):
            "org/x has no revision 'dev' on the Hugging Face Hub (a branch, tag or commit hash)",
        errors.HfHubHTTPError("500 Server Error\nmore", response=httpx.Response(500, request=response.request)):
            "the Hugging Face Hub answered 500 for org/x@dev: 500 Server Error",
    }
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    for exc, message in cases.items():
        def raise_it(*a, exc=exc, **k):
            raise exc
        monkeypatch.setattr(huggingface_hub, "snapshot_download", raise_it)
        with pytest.raises(MoeOffloadError) as info:
            hubmod.snapshot("org/x@dev", progress=False)
        assert str(info.value) == message
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_xxx")
    assert hubmod.hub_error("org/x", errors.GatedRepoError("gated", response=response)) == (
        "org/x is a gated repository and your token has no access to it: accept its conditions on "
        "https://huggingface.co/org/x")


COMMANDS = {
    "generate": lambda m: ["generate", "--model", m, *GEN],
    "serve": lambda m: ["serve", "--model", m, "--port", "0", "--quiet"],
    "bench decode": lambda m: ["bench", "decode", "--model", m, "--prompt", "hi", "--residencies", "0.5", "--quiet"],
    "trace collect": lambda m: ["trace", "collect", "--model", m, "--prompt", "hi", "--out", "t.trace",
                                "--max-new-tokens", "4", "--quiet"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_taking_model_resolves_hub_names(capsys, hub, command):
    """generate, serve, bench decode and trace collect: the same one-line errors for an uncached and a pickle-only
    repository (they share ``resolve_model``)."""
    line = _one_line(capsys, COMMANDS[command]("org/absent"))
    assert line.startswith(f"moe-offload: error: org/absent is not in the Hugging Face cache {hub} and "
                           "HF_HUB_OFFLINE=1")
    line = _one_line(capsys, COMMANDS[command]("org/pickled"))
    assert line.startswith("moe-offload: error: org/pickled has no *.safetensors weights (it holds pytorch_model.bin)")


def test_trace_collect_from_a_hub_name(capsys, hub, tiny_dirs):
    """trace collect runs on the cached snapshot (tag v1) and records the routing of that checkpoint."""
    from moe_offload.models.checkpoint import model_fingerprint
    from moe_offload.trace.format import load_trace

    assert main(COMMANDS["trace collect"]("org/tiny@v1")) == 0
    trace = load_trace("t.trace")
    config = json.loads((tiny_dirs["qwen3_moe"] / "config.json").read_text())
    assert trace.header["model_id"] == model_fingerprint(config)
    assert trace.num_requests == 1 and trace.num_experts == 16 and len(trace.expert_ids) > 0


REPO_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md",
              ".gitattributes", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
              "model-00002-of-00002.safetensors", "consolidated.safetensors", "pytorch_model.bin", "model.gguf",
              "original/consolidated.00.pth", "original/params.json", "original/model.safetensors",
              "preprocessor_config.json"]


@pytest.mark.parametrize("with_index", [True, False])
def test_only_what_the_engine_reads_is_downloaded(tmp_path, monkeypatch, with_index):
    """A stand-in for the Hub (``snapshot_download`` applying huggingface_hub's own pattern filter to a listing):
    first the metadata at the asked revision, then the shards the index names (without an index: every top-level
    safetensors file), pinned to the snapshot's commit; no pickle, GGUF or subfolder file, and with an index no stray
    safetensors (consolidated.safetensors)."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from moe_offload.models import hub as hubmod

    snap, calls = tmp_path / "snapshots" / COMMIT_A, []
    snap.mkdir(parents=True)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}

    listing = [f for f in REPO_FILES if with_index or not f.endswith("index.json")]

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, ignore_patterns=None, **kw):
        got = list(filter_repo_objects(listing, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        calls.append((repo_id, revision, sorted(got)))
        for name in got:
            (snap / name).parent.mkdir(parents=True, exist_ok=True)
            (snap / name).write_text(json.dumps(index) if name.endswith("index.json") else "x")
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert hubmod.snapshot("org/big@v2", progress=False) == snap
    meta = ["config.json", "generation_config.json"] + ["model.safetensors.index.json"] * with_index
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert calls == [("org/big", "v2", meta + ["tokenizer.json", "tokenizer_config.json"]),
                     ("org/big", COMMIT_A, shards if with_index else ["consolidated.safetensors"] + shards)]
    assert sorted(str(p.relative_to(snap)) for p in snap.rglob("*")) == sorted(calls[0][2] + calls[1][2])
