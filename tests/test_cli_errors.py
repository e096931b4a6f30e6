"""Bad input: one line on stderr, exit status 2, no traceback, nothing of the user's overwritten."""

import json
import shutil
import os
import subprocess
import sys

import pytest

from moe_offload.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def assert_one_line_error(code, err, needle):
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("moe-offload: error: "), err
    assert needle in lines[0], err


def gen(model, *extra):
    return ("generate", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "2", "--quiet", *extra)


def test_missing_directory(capsys, tmp_path):
    assert_one_line_error(*run_cli(capsys, *gen(tmp_path / "nope")), "model directory not found")


def test_directory_without_config(capsys, tmp_path):
    assert_one_line_error(*run_cli(capsys, *gen(tmp_path)), "has no config.json")


def test_directory_without_weights(capsys, tmp_path, tiny_dirs):
    shutil.copy(tiny_dirs["mixtral"] / "config.json", tmp_path / "config.json")
    assert_one_line_error(*run_cli(capsys, *gen(tmp_path)), "has no *.safetensors")


def test_dense_model_refused(capsys, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=64)).save_pretrained(tmp_path)
    code, err = run_cli(capsys, *gen(tmp_path))
    assert_one_line_error(code, err, "llama declares no experts through transformers' ExpertsInterface")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_truncated_safetensors(capsys, tmp_path, tiny_dirs):
    d = _copy(tiny_dirs["qwen3_moe"], tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert_one_line_error(*run_cli(capsys, *gen(d)), "is truncated")


def test_corrupt_safetensors(capsys, tmp_path, tiny_dirs):
    d = _copy(tiny_dirs["qwen3_moe"], tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    assert_one_line_error(*run_cli(capsys, *gen(d)), "not a readable safetensors file")


@pytest.mark.parametrize("value", ["0", "-0.2", "1.5", "nan"])
def test_residency_out_of_range(capsys, tiny_dirs, value):
    assert_one_line_error(*run_cli(capsys, *gen(tiny_dirs["olmoe"], "--residency", value)), "--residency must be")


def test_slots_below_top_k(capsys, tiny_dirs):
    assert_one_line_error(*run_cli(capsys, *gen(tiny_dirs["olmoe"], "--slots", "3")), "fewer than top-k = 4")


def test_unknown_policy(capsys, tiny_dirs):
    assert_one_line_error(*run_cli(capsys, *gen(tiny_dirs["olmoe"], "--policy", "fifo")), "unknown policy 'fifo'")


def test_unreadable_prompts_file(capsys, tmp_path, tiny_dirs):
    args = ("generate", "--model", str(tiny_dirs["olmoe"]), "--prompts", str(tmp_path / "missing.txt"), "--quiet")
    assert_one_line_error(*run_cli(capsys, *args), "cannot read prompts file")


def test_tiny_refuses_to_overwrite(capsys, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    assert_one_line_error(*run_cli(capsys, "testbed", "tiny", "--arch", "mixtral", "--out", str(tmp_path)),
                          "already exists")
    assert (tmp_path / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_unknown_arch_for_tiny(capsys, tmp_path):
    assert_one_line_error(*run_cli(capsys, "testbed", "tiny", "--arch", "llama", "--out", str(tmp_path / "x")),
                          "llama declares no experts through transformers' ExpertsInterface")
    assert_one_line_error(*run_cli(capsys, "testbed", "tiny", "--arch", "no_such_moe", "--out", str(tmp_path / "y")),
                          "model_type 'no_such_moe' is not known to the installed transformers")


def test_console_script_error_has_no_traceback(tmp_path):
    """The installed entry point (a real process) prints one line and exits 2. (OMP_NUM_THREADS set: on a busy machine
    the thread probe of a command run from the shell would add its own line, common.threads.command_threads.)"""
    r = subprocess.run([sys.executable, "-m", "moe_offload.cli", "generate", "--model", str(tmp_path / "nope"),
                        "--prompt", "x"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0


def test_generate_json(capsys, tiny_dirs):
    code = main(list(gen(tiny_dirs["mixtral"], "--json", "--residency", "0.5")))
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    s = out["stats"]
    assert len(out["outputs"]) == 1 and len(out["outputs"][0]["token_ids"]) == 2
    for key in ("hit_rate", "hits", "misses", "bytes_loaded", "decode_tokens_per_s", "ttft_s", "slots", "residency"):
        assert key in s
    assert s["slots"] == 12 and s["residency"] == 0.5  # 3 MoE layers x 8 experts (Mixtral's default count)
    assert s["bytes_loaded"] == s["misses"] * s["expert_bytes"]  # every miss is one on-demand load of one expert


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--max-new-tokens", "0"], "expected a positive integer"),
    (["simulate"], "the following arguments are required: --trace, --out"),
    (["frob"], "invalid choice: 'frob'"),
])
def test_argparse_errors_are_one_line(capsys, argv, needle):
    with pytest.raises(SystemExit) as ex:
        main(argv)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert ex.value.code == 2 and len(lines) == 1 and needle in lines[0] and "error:" in lines[0]


@pytest.mark.parametrize("edit,message", [
    ({"num_experts_per_tok": 99}, "config.json: top-k 99 exceeds the 16 experts"),
    ({"n_group": 3}, "config.json: n_group = 3 does not divide the 16 experts"),
    ({"topk_group": 9}, "config.json: topk_group = 9 exceeds n_group = 4"),
    ({"moe_intermediate_size": 0}, "config.json: moe_intermediate_size = 0 must be positive"),
])
def test_config_disagreeing_with_itself_is_one_line_before_any_work(tiny_dirs, tmp_path, capsys, edit, message):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs["deepseek_v3"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(edit)
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", "--model", str(d), "--prompt", "hi", "--residency", "0.5", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_graph_seqmoe_refusals_are_one_line(tiny_dirs, capsys, tmp_path):
    """From a new user's try: --predictor-lag with --graph was silently ignored, and a pool of exactly one layer's
    experts got an error about an internal "reserve" range."""
    d = tiny_dirs["qwen3_moe"]  # 3 MoE layers x 16 experts
    pred = tmp_path / "pred"  # any directory: both refusals come before the predictor is read
    pred.mkdir()
    assert_one_line_error(*run_cli(capsys, *gen(d, "--graph", "--policy", "seqmoe", "--predictor", str(pred),
                                                 "--predictor-lag", "2")), "--predictor-lag runs the predictor")
    assert_one_line_error(*run_cli(capsys, *gen(d, "--graph", "--policy", "seqmoe", "--predictor", str(pred),
                                                 "--slots", "16")), "needs at least 17 slots")
