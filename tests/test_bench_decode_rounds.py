"""`bench decode --rounds`: every row measured in interleaved rounds, merged into medians (bench.decode_rows)."""

import pytest

from moe_offload.bench.decode_rows import DecodeRow, baseline_policy, median_round, median_rows, round_order, table
from moe_offload.cli import main
from moe_offload.core.policy_spec import parse_policy

LRU, XL = parse_policy("lru"), parse_policy("xl+gate")


def row(pol, residency, tok_s, hit=0.5, same=True):
    return DecodeRow(pol.name, pol, residency, 10, tok_s, 0.0, hit, 100, 1.0, same, 1000)


def test_rounds_alternate_the_order():
    assert round_order([0, 1, 2], 0) == [0, 1, 2]
    assert round_order([0, 1, 2], 1) == [2, 1, 0]
    assert round_order([0, 1, 2], 2) == [0, 1, 2]


def test_the_baseline_is_lru_when_listed():
    assert baseline_policy([XL, LRU]) == LRU
    assert baseline_policy([XL, parse_policy("lfu")]) == XL
    assert baseline_policy([XL]) is None and baseline_policy([LRU, LRU]) is None


def test_the_median_round_is_the_lower_middle_one():
    assert median_round([5.0, 3.0, 4.0]) == 2
    assert median_round([5.0, 3.0, 4.0, 6.0]) == 2   # 3 < 4 < 5 < 6: the lower of the two middle ones
    assert median_round([7.0]) == 0
    assert median_round([2.0, 2.0, 2.0]) == 1         # ties: in round order
    with pytest.raises(ValueError):
        median_round([])


def test_median_rows_by_hand():
    """Three rounds of lru and xl+gate at one residency, FullLoad 10, 8, 10 tok/s: tok/s and ratios are medians
    of the rounds, vs lru pairs the rounds (xl+gate over lru: 6/5, 4/4, 7/6 -> median 7/6), the other columns come
    from each row's median round, and the tokens must be FullLoad's in every round."""
    lru = [(row(LRU, 0.25, 5.0, hit=0.70), {"k": 0}), (row(LRU, 0.25, 4.0, hit=0.71), {"k": 1}),
           (row(LRU, 0.25, 6.0, hit=0.72), {"k": 2})]
    xl = [(row(XL, 0.25, 6.0, hit=0.80), {"k": 0}), (row(XL, 0.25, 4.0, hit=0.81, same=False), {"k": 1}),
          (row(XL, 0.25, 7.0, hit=0.82), {"k": 2})]
    (r_lru, b_lru), (r_xl, b_xl) = median_rows([lru, xl], [10.0, 8.0, 10.0], LRU)
    assert (r_lru.tok_s, r_lru.tok_s_range, r_lru.hit_rate, b_lru) == (5.0, (4.0, 6.0), 0.70, {"k": 0})
    assert r_lru.ratio == pytest.approx(0.5)                       # median of 0.5, 0.5, 0.6
    assert r_lru.vs_baseline == 1.0 and r_lru.same
    assert (r_xl.tok_s, r_xl.tok_s_range, r_xl.hit_rate, b_xl) == (6.0, (4.0, 7.0), 0.80, {"k": 0})
    assert r_xl.ratio == pytest.approx(0.6)                        # median of 0.6, 0.5, 0.7
    assert r_xl.vs_baseline == pytest.approx(7 / 6)                # median of 1.2, 1.0, 7/6
    assert not r_xl.same                                           # round 2's tokens differed
    assert lru[0][0].tok_s == 5.0 and lru[0][0].tok_s_range is None  # the measured rows are left as they were
    # one round: no range, no ratio to the baseline; the table keeps its one-round columns
    (one, _), = median_rows([[(row(XL, 0.45, 9.0), {})]], [12.0], LRU)
    assert (one.tok_s, one.ratio, one.tok_s_range, one.vs_baseline) == (9.0, 0.75, None, None)
    assert table([one], "lru")[0].startswith("| policy | residency | slots | decode tok/s | vs FullLoad | simulated")
    with pytest.raises(ValueError, match="2 rounds"):
        median_rows([lru], [10.0, 8.0])
    # lru listed twice at one residency: each is set against the first
    (a, _), (b, _) = median_rows([lru, [(row(LRU, 0.25, 2 * r.tok_s), {}) for r, _ in lru]], [10.0, 8.0, 10.0], LRU)
    assert (a.vs_baseline, b.vs_baseline) == (1.0, 2.0)


def test_bench_decode_in_rounds(tiny_dirs, capsys):
    """Two rounds of lfu and lru on a tiny model: FullLoad's tokens in every round of every row, each row's range
    of tok/s, and the ratio to lru though it is listed second (1 for lru itself); a bad --rounds is a one-line
    error."""
    d = str(tiny_dirs["mixtral"])
    assert main(["bench", "decode", "--model", d, "--prompt", "hi there", "--max-new-tokens", "3", "--quiet",
                 "--residencies", "0.5", "--policy", "lfu,lru", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    lines = [ln.split(" | ") for ln in out.splitlines() if ln.startswith("| ")]
    head = lines[0]
    assert head[:7] == ["| policy", "residency", "slots", "decode tok/s", "tok/s min-max", "vs FullLoad", "vs lru"]
    body = {r[0][2:]: dict(zip(head, r)) for r in lines[1:4]}
    assert list(body) == ["FullLoad", "lfu", "lru"]
    assert all(r["same tokens"] == "yes" for r in body.values())
    assert body["lru"]["vs lru"] == "1.000" and float(body["lfu"]["vs lru"]) > 0 and body["FullLoad"]["vs lru"] == "-"
    lo, hi = (float(x) for x in body["lfu"]["tok/s min-max"].split("-"))
    assert 0 < lo <= float(body["lfu"]["decode tok/s"]) <= hi
    assert "each row measured in 2 rounds" in out
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "decode", "--model", d, "--rounds", "0"])
    assert exit_.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "--rounds" in err[0] and "[1, 100]" in err[0]
