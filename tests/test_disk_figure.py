"""The README's picture (``bench/disk_figure.py``): drawn from the committed ``bench disk`` results; bad input is a
one-line error and nothing is overwritten without ``--force``."""

from pathlib import Path

import pytest

from moe_offload.bench import disk_figure
from moe_offload.bench.disk_figure import read_run, share_figure
from moe_offload.cli import main as cli_main
from moe_offload.errors import MoeOffloadError

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
WIDE = [RESULTS / "bench-disk-wide-cpu", RESULTS / "bench-disk-wide-cpu-reversed"]
SPARSE = [RESULTS / "bench-disk-sparse-cpu", RESULTS / "bench-disk-sparse-cpu-reversed"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def main(argv: list[str]) -> int:
    """``moe-offload bench disk-figure ARGV``."""
    return cli_main(["bench", "disk-figure", *argv])


def one_line_error(capsys, argv, needle):
    assert main([str(a) for a in argv]) == 2
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("moe-offload: error: "), captured.err
    assert needle in lines[0], lines[0]


def test_figure_from_the_committed_results(tmp_path):
    out = tmp_path / "img" / "decode-vs-share.png"
    specs = [f"testbed-sparse-wide={d}" for d in WIDE] + [f"testbed-sparse={d}" for d in SPARSE]
    assert share_figure(specs, out) == out
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000
    assert not [p for p in out.parent.iterdir() if p != out]  # no temporary file left beside it


def test_main_writes_and_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "f.png"
    assert main([str(d) for d in SPARSE] + ["--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    before = out.read_bytes()
    one_line_error(capsys, [*SPARSE, "--out", out], "already exists; pass --force")
    assert out.read_bytes() == before
    assert main([str(d) for d in WIDE] + ["--out", str(out), "--force"]) == 0
    assert out.read_bytes() != before and out.read_bytes().startswith(PNG_MAGIC)


def test_panels_titles_and_unfinished_cells():
    forward, reversed_ = (read_run(d) for d in WIDE)
    assert forward.model == reversed_.model == "bench-disk-wide-cpu"  # a run and its --reverse twin: one panel
    assert read_run(f"testbed-sparse-wide={WIDE[0]}").model == "testbed-sparse-wide"
    assert forward.expert_bytes == pytest.approx(2.548e9)  # results.md's "Expert bytes" (no results.json here)
    groups = disk_figure.panels([forward, reversed_, read_run(SPARSE[0])])
    assert list(groups) == ["bench-disk-wide-cpu", "bench-disk-sparse-cpu"] and len(groups["bench-disk-wide-cpu"]) == 2
    note = disk_figure._note(disk_figure._series([forward, reversed_]))
    assert "llama.cpp (mmap), timeout: 25% (2 of 2 runs), 10% (1 of 2 runs)" in note
    assert "disk seqmoe (ours), failed: 45% (1 of 2 runs)" in note
    assert disk_figure._note(disk_figure._series([read_run(d) for d in SPARSE])) == "every cell finished"


def test_model_recorded_in_results_json(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.csv").write_text("row,fraction,status,decode_tok_s\ndisk lru (ours),0.45,ok,3.5\n")
    (run / "results.json").write_text('{"model": "qwen3-30b", "expert_bytes": 1e9}')
    got = read_run(run)
    assert (got.model, got.expert_bytes) == ("qwen3-30b", 1e9)
    assert got.cells[0].ok and got.cells[0].tok_s == 3.5


@pytest.mark.parametrize("csv_text, needle", [
    ("row,fraction,status\ndisk lru (ours),0.45,ok\n", "no column decode_tok_s"),
    ("a,b\n1,2\n", "no column row, fraction, status, decode_tok_s"),
    ("row,fraction,status,decode_tok_s\n", "no rows"),
    ("row,fraction,status,decode_tok_s\ndisk lru (ours),half,ok,3.5\n", "line 2: fraction 'half' is not a number"),
    ("row,fraction,status,decode_tok_s\ndisk lru (ours),1.5,ok,3.5\n", "fraction 1.5 is not in (0, 1]"),
    ("row,fraction,status,decode_tok_s\ndisk lru (ours),0.45,ok,\n", "is ok but has no positive decode_tok_s"),
])
def test_malformed_csv_is_a_one_line_error(tmp_path, capsys, csv_text, needle):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.csv").write_text(csv_text)
    one_line_error(capsys, [run, "--out", tmp_path / "f.png"], needle)
    with pytest.raises(MoeOffloadError, match="results.csv"):
        share_figure([run], tmp_path / "g.png")
    assert not (tmp_path / "f.png").exists() and not (tmp_path / "g.png").exists()


def test_missing_folder_csv_and_bad_out(tmp_path, capsys):
    one_line_error(capsys, [tmp_path / "nope", "--out", tmp_path / "f.png"], "nope: no such folder")
    one_line_error(capsys, [tmp_path, "--out", tmp_path / "f.png"], "no results.csv")
    one_line_error(capsys, [*SPARSE, "--out", tmp_path / "f.svg"], "expected a .png file name")
    (tmp_path / "d.png").mkdir()
    one_line_error(capsys, [*SPARSE, "--out", tmp_path / "d.png", "--force"], "exists and is not a file")


def test_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--out", "f.png"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("moe-offload bench disk-figure: error:")
