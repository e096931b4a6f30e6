"""``--model`` given something that exists but is not a checkpoint directory (issue 34): a GGUF file was reported as
"model directory not found". Each case is one line saying what the path is and what is read instead, for generate,
serve and ``models --config``; nothing is started."""

import shutil

import pytest

from moe_offload.cli import main

HF_DIR = "a Hugging Face checkpoint directory (config.json + *.safetensors)"
GGUF_HEADER = b"GGUF\x03\x00\x00\x00" + bytes(16)  # magic, version 3, tensor / metadata counts


def _one_line(capsys, argv) -> str:
    code = main(argv)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("moe-offload: error: "), lines
    return lines[0]


COMMANDS = {
    "generate": lambda m: ["generate", "--model", str(m), "--prompt", "hi", "--max-new-tokens", "2", "--quiet"],
    "serve": lambda m: ["serve", "--model", str(m), "--port", "0", "--quiet"],
}


@pytest.fixture
def paths(tmp_path, tiny_dirs):
    """``{case: path}``: files and directories that are not checkpoint directories."""
    gguf = tmp_path / "Qwen3-30B-A3B-Q4_K_M.gguf"
    gguf.write_bytes(GGUF_HEADER)
    no_suffix = tmp_path / "model"
    no_suffix.write_bytes(GGUF_HEADER)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with_gguf, empty = tmp_path / "gguf-dir", tmp_path / "empty"
    with_gguf.mkdir()
    empty.mkdir()
    shutil.copy(gguf, with_gguf / gguf.name)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs["qwen3_moe"], ckpt)
    return {"gguf": gguf, "gguf-magic": no_suffix, "text": text, "gguf-dir": with_gguf, "empty": empty,
            "safetensors": ckpt / "model.safetensors", "config": ckpt / "config.json", "ckpt": ckpt}


EXPECT = {
    "gguf": "{p} is a GGUF file (llama.cpp's format), which moe-offload does not read: give " + HF_DIR,
    "gguf-magic": "{p} is a GGUF file (llama.cpp's format)",
    "text": "{p} is a .txt file, not a directory: give " + HF_DIR,
    "gguf-dir": "{p} holds GGUF files (Qwen3-30B-A3B-Q4_K_M.gguf) and no config.json: moe-offload does not read GGUF",
    "empty": "{p} has no config.json: not " + HF_DIR,
    "safetensors": "{p} is a safetensors file, not a directory: give the checkpoint directory holding it, {ckpt}",
    "config": "{p} is a config.json file, not a directory: give the checkpoint directory holding it, {ckpt}",
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(EXPECT))
def test_not_a_checkpoint_directory(capsys, paths, command, case):
    line = _one_line(capsys, COMMANDS[command](paths[case]))
    assert EXPECT[case].format(p=paths[case], ckpt=paths["ckpt"]) in line
    assert "not found" not in line


@pytest.mark.parametrize("case", ["gguf", "gguf-magic", "gguf-dir", "empty"])
def test_models_config_names_what_it_was_given(capsys, paths, case):
    """``models --config`` takes a config.json or its directory: a GGUF file or a directory without config.json is
    named as such."""
    line = _one_line(capsys, ["models", "--config", str(paths[case])])
    assert EXPECT[case].format(p=paths[case], ckpt=paths["ckpt"]) in line


def test_the_checkpoint_itself_is_accepted(capsys, paths):
    assert main(["models", "--config", str(paths["config"])]) == 0
    assert main(["models", "--config", str(paths["ckpt"])]) == 0
    assert main(list(COMMANDS["generate"](paths["ckpt"]))) == 0
