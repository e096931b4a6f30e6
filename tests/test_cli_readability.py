"""Numbers and options that read right (issue 15): `trace info` step counts add up, `simulate` picks and names the
profiles matching the trace, `bench link` says where it wrote, `--version`, a description and default for every
option, closest built-in names for unknown models, offload notes (what the hit rate means, LRU thrashing), and
integer edges of the CLI (one-line errors)."""

import argparse
import csv
import json

import pytest

from moe_offload.cli import build_parser, main
from moe_offload.errors import MoeOffloadError
from moe_offload.generation.generate import generate_ids
from moe_offload.models.loader import load_offloaded
from moe_offload.generation.report import offload_notes
from moe_offload.common.seeds import SEED_MAX, check_seed, seed_problem
from moe_offload.trace.collect import TraceRecorder
from moe_offload.trace.synthetic import synthetic_trace


def _one_line_error(capsys, argv, needle):
    with pytest.raises(SystemExit) as ex:
        main(argv)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert ex.value.code == 2 and len(lines) == 1 and needle in lines[0], lines


def test_trace_info_step_counts_add_up(tiny_dirs, tmp_path, capsys):
    from moe_offload.generation.generate import run

    lm = load_offloaded(tiny_dirs["qwen3_moe"], device="cpu", slots=10, progress=False)
    with TraceRecorder(lm) as rec:
        run(lm, ["Hello there, how are you?", "Slots are shared."], 6, recorder=rec)
        tr = rec.trace()
    prompt_tokens = int((tr.step == 0).sum())
    tr.save(tmp_path / "t.trace")
    assert main(["trace", "info", str(tmp_path / "t.trace")]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("steps:"))
    # 2 requests: one prefill step each + 5 decode steps each (the 6th token is never fed back)
    assert line.split(":", 1)[1].strip() == (f"12 = 2 prefill steps (one per request; {prompt_tokens} prompt tokens "
                                             "in all) + 10 decode steps (one token each)")
    assert main(["trace", "info", str(tmp_path / "t.trace"), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["steps"] == st["prefill_steps"] + st["decode_steps"] == 12 and st["prefill_tokens"] == prompt_tokens


def _trace(tmp_path, layers, experts, k, model_id):
    tr = synthetic_trace(layers, experts, k, steps=5, requests=2, prompt_tokens=3, seed=1)
    tr.header["synthetic"] = False
    tr.header["model_id"] = model_id
    return str(tr.save(tmp_path / f"{layers}x{experts}x{k}.trace"))


def test_simulate_picks_the_profiles_of_the_traces_model_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path / "cache"))  # no this-machine profile
    t = _trace(tmp_path, 30, 32, 8, "mixtral-0123456789ab")  # a testbed-sparse trace
    assert main(["simulate", "--trace", t, "--residency", "0.25", "--policy", "lru", "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("profiles: model testbed-sparse (matches the trace: mixtral, 30 MoE layers x 32 "
                                   "experts, top-8); hardware rtx4090 (default; `moe-offload bench link` would "
                                   "measure this machine)")
    assert "projected speed: not computed (testbed-sparse has no FullLoad speed on rtx4090" in out
    rows = list(csv.DictReader(open(tmp_path / "a" / "results.csv")))
    assert rows[0]["model"] == "testbed-sparse" and "projected_tok_s" not in rows[0]
    # measured this machine: the testbed's own hardware; a FullLoad speed given: speed projected
    (tmp_path / "cache" / "hardware").mkdir(parents=True)
    (tmp_path / "cache" / "hardware" / "this-machine.json").write_text(json.dumps(
        {"name": "this-machine", "device_memory_gb": 8, "link": "memcpy", "link_gbps": 10.0}))
    assert main(["simulate", "--trace", t, "--residency", "0.25", "--policy", "lru", "--full-load-tok-s", "20",
                 "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "hardware this-machine (testbed-sparse runs on this machine" in out.splitlines()[0]
    rows = list(csv.DictReader(open(tmp_path / "b" / "results.csv")))
    assert rows[0]["hardware"] == "this-machine" and float(rows[0]["full_load_tok_s"]) == 20.0
    # a geometry no profile has: the documented default, said as such
    u = _trace(tmp_path, 3, 8, 2, "qwen3_moe-0123456789ab")
    assert main(["simulate", "--trace", u, "--residency", "0.5", "--policy", "lru", "--out", str(tmp_path / "c")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == ("profiles: model qwen3-30b-a3b-fp8 (default: no shipped profile matches the trace's 3 MoE layers "
                     "x 8 experts, top-2; its miss rates are projected onto it); hardware rtx4090 (qwen3-30b-a3b-fp8 "
                     "has a measured FullLoad speed on it)")
    # named profiles are used as given
    assert main(["simulate", "--trace", t, "--residency", "0.5", "--policy", "lru", "--model-profile",
                 "qwen3-30b-a3b-fp8", "--hardware", "h200", "--out", str(tmp_path / "d")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == ("profiles: model qwen3-30b-a3b-fp8 (--model-profile); hardware "
                                                       "h200 (--hardware)")


def test_bench_link_says_where_it_wrote(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path))
    assert main(["bench", "link", "--device", "cpu", "--size-mb", "1"]) == 0
    cap = capsys.readouterr()
    path = tmp_path / "hardware" / "this-machine.json"
    assert json.loads(cap.out)["name"] == "this-machine" and path.is_file()
    assert f"wrote the this-machine hardware profile to {path}" in cap.err
    _one_line_error(capsys, ["bench", "link", "--size-mb", "100000"], "expected an integer in [1, 16384]")


def test_version(capsys):
    with pytest.raises(SystemExit) as ex:
        main(["--version"])
    assert ex.value.code == 0 and capsys.readouterr().out.startswith("moe-offload 0.1.0 (torch ")


def _parsers(p, path):
    yield path, p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                yield from _parsers(sp, path + [name])


def test_every_option_has_a_description_and_its_default():
    missing = []
    for path, p in _parsers(build_parser(), ["moe-offload"]):
        fmt = p._get_formatter()
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction)):
                continue
            text = fmt._get_help_string(a) if a.help else ""
            if not text.strip():
                missing.append((" ".join(path), a.dest, "no description"))
            elif a.option_strings and a.nargs != 0 and not a.required and "default" not in text:
                missing.append((" ".join(path), a.dest, "no default"))
    assert missing == []


def test_unknown_model_name_suggests_the_closest_built_in(capsys):
    assert main(["generate", "--model", "testbed-spars", "--prompt", "hi", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("moe-offload: error: model directory not found: testbed-spars; did you mean the built-in model "
                   "testbed-sparse? (built-in models: testbed, testbed-sparse, testbed-sparse-wide, llada2-medium; a "
                   "Hugging Face Hub "
                   "model: ORG/NAME[@REVISION])")
    assert main(["generate", "--model", "zzzz", "--prompt", "hi", "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == ("moe-offload: error: model directory not found: zzzz; (built-in models: "
                                               "testbed, testbed-sparse, testbed-sparse-wide, llada2-medium; a Hugging Face "
                                               "Hub model: ORG/NAME[@REVISION])")


def test_generate_explains_the_hit_rate_and_names_lru_thrashing(tiny_dirs, capsys):
    d = str(tiny_dirs["mixtral"])
    base = ["generate", "--model", d, "--prompt", "Hello there, how are you today?", "--max-new-tokens", "8",
            "--quiet", "--slots", "4", "--policy", "lru"]
    assert main(base + ["--json"]) == 0
    st = json.loads(capsys.readouterr().out)["stats"]
    per_step = st["num_moe_layers"] * st["top_k"]
    assert st["policy"] == "lru" and st["slots"] < per_step and st["hit_rate"] < 0.05  # experts cycle through 4 slots
    assert st["notes"][0].startswith(f"hit rate {st['hit_rate']:.1%}: {st['hits']} of the "
                                     f"{st['hits'] + st['misses']} times a layer needed an expert, it was already in "
                                     "the 4 device slots")
    assert st["notes"][1] == (f"LRU evicts every expert before its reuse at this residency (a step needs up to "
                              f"{per_step} experts, {st['num_moe_layers']} layers x top-{st['top_k']}, and they "
                              "cycle through 4 slots): try --policy lfu")
    assert main(base) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("hit rate ") and out[-1] == st["notes"][1]  # the text report ends with the notes
    assert main(base + ["--policy", "lfu", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["stats"]["notes"]
    assert len(notes) == 1 and notes[0].startswith("hit rate")
    assert main(["generate", "--model", d, "--prompt", "hi", "--max-new-tokens", "3", "--quiet", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["notes"] == []  # residency 1: nothing to explain


def test_offload_notes_by_hand():
    d = {"mode": "offload", "policy": "lru", "residency": 0.25, "hits": 0, "misses": 720, "hit_rate": 0.0,
         "slots": 240, "bytes_loaded": 720 * 1024, "num_moe_layers": 30, "top_k": 24}
    notes = offload_notes(d)
    assert notes[0] == ("hit rate 0.0%: 0 of the 720 times a layer needed an expert, it was already in the 240 device "
                        "slots; the 720 misses were copied from the host store (720.0 KiB)")
    assert notes[1].startswith("LRU evicts every expert before its reuse at this residency (a step needs up to 720")
    assert len(offload_notes(d | {"hits": 100, "hit_rate": 100 / 820})) == 1  # LRU that hits is not thrashing
    assert offload_notes(d | {"mode": "full-load", "policy": None}) == []


def test_seed_range_is_one_documented_mapping(tiny_dirs, capsys):
    assert seed_problem(0) is None and seed_problem(SEED_MAX) is None
    for bad in (-1, SEED_MAX + 1, 2**64, True, 1.5):
        assert seed_problem(bad) == f"seed must be an integer in [0, 4294967295], got {bad}"
    with pytest.raises(MoeOffloadError, match=r"seed must be an integer in \[0, 4294967295\], got -1"):
        check_seed(-1)
    lm = load_offloaded(tiny_dirs["mixtral"], device="cpu", progress=False)
    with pytest.raises(MoeOffloadError, match="got 4294967296"):
        generate_ids(lm, [1, 2, 3], 2, temperature=1.0, seed=2**32)
    _one_line_error(capsys, ["generate", "--seed", "18446744073709551616"],
                    "argument --seed: seed must be an integer in [0, 4294967295], got 18446744073709551616")
    _one_line_error(capsys, ["generate", "--seed", "-1"], "seed must be an integer in [0, 4294967295], got -1")
    _one_line_error(capsys, ["testbed", "tiny", "--arch", "mixtral", "--out", "x", "--seed", str(2**40)],
                    "seed must be an integer")


def test_an_empty_output_says_why(capsys, monkeypatch):
    """A generation whose tokens decode to nothing (an EOS first) is said so, not printed as a blank."""
    import argparse

    from moe_offload.cli import generate as gen_cli
    from moe_offload.generation.generate import Output

    monkeypatch.setattr("moe_offload.generation.report.stats_table", lambda info: "stats")
    args = argparse.Namespace(json=False, max_new_tokens=8)
    outs = [Output("hi", "", [2], 3, 0.1, 0.0, "stop"), Output("yo", "fine", [5, 6], 3, 0.1, 0.1, "length")]
    assert gen_cli._print_outputs(args, "m", outs, {}) is False
    out = capsys.readouterr().out
    assert "(no text: the model ended with 1 token that decodes to nothing, finish reason stop)" in out
    assert "### output\nfine\n" in out
