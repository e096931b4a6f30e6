"""SeqMoE predictors in a decode batch (``predictor.batch_feed``, issue 18): one predictor state per sequence, the
union of the sequences' forecasts as the one demand the policy sees; lossless; a batch of one is the
single-sequence ``ForecastFeed`` exactly."""

import pytest
import torch

from moe_offload.generation.batching import generate_batch_ids
from moe_offload.generation.generate import generate_ids
from moe_offload.models.loader import load_offloaded
from moe_offload.predictor.batch_feed import BatchForecastFeed, attach_batch_predictor
from moe_offload.predictor.batch_forecast import union_probs
from moe_offload.core.forecast import ROLLOUT_EVERY
from moe_offload.predictor.runtime import ForecastFeed, PredictorRunner

ARCH = "mixtral"
PROMPTS = [[5, 9, 3, 12, 7], [4, 10, 2], [8, 8, 1, 6, 11, 3, 2], [7, 1]]
NEW = 8


pytestmark = pytest.mark.usefixtures("one_thread")


class Spy:
    """A consumer that keeps every forecast it is handed."""

    def __init__(self):
        self.seen = []

    def observe(self, forecast):
        self.seen.append(forecast)


def test_batch_of_one_is_the_single_sequence_feed(tiny_dirs, random_pset):
    """Max batch 1: the policy is handed bitwise the forecasts of ``ForecastFeed`` over ``generate_ids``, and the
    slot table's hits and misses are the same."""
    runs = []
    for batched in (True, False):
        lm = load_offloaded(tiny_dirs[ARCH], residency=0.5, policy="seqmoe-cacheonly", progress=False)
        spy, pset = Spy(), random_pset(lm, 1)
        if batched:
            lm.engine.observers.append(BatchForecastFeed(pset, lm.engine.table.policy, spy, rollout=7))
            toks = [s.new for s in generate_batch_ids(lm, PROMPTS, NEW, 1)]
        else:
            runner = PredictorRunner(pset, rollout=7, rollout_every=ROLLOUT_EVERY)
            lm.engine.observers.append(ForecastFeed(runner, lm.engine.table.policy, spy))
            toks = [generate_ids(lm, p, NEW, request=i)[0] for i, p in enumerate(PROMPTS)]
        runs.append((toks, spy.seen, lm.engine.stats.hits, lm.engine.stats.misses))
    (tb, fb, hb, mb), (ts, fs, hs, ms) = runs
    assert tb == ts and (hb, mb) == (hs, ms) and mb > 0
    assert len(fb) == len(fs) > 0
    assert all(a.layers == b.layers and torch.equal(a.probs, b.probs) for a, b in zip(fb, fs))


@pytest.mark.parametrize("policy", ["seqmoe-cacheonly", "seqmoe"])
def test_batch_forecasts_are_the_union_and_tokens_stay_lossless(tiny_dirs, random_pset, policy):
    """Max batch 3, several prompts per prefill pass: every forecast the policy gets is the union
    ``1 - prod_s (1 - p_s)`` of the forecasts the per-sequence runners made in that pass (one per sequence of the
    pass), tokens equal LRU at residency 1.0, and sequences that leave drop their predictor state; with ``seqmoe``
    the prefetcher gets the same forecasts (after the policy)."""
    ref = load_offloaded(tiny_dirs[ARCH], residency=1.0, progress=False)
    want = [s.new for s in generate_batch_ids(ref, PROMPTS, NEW, 3, prefill_tokens=16)]
    lm = load_offloaded(tiny_dirs[ARCH], residency=0.5, policy=policy, progress=False)
    feed = attach_batch_predictor(lm.engine, random_pset(lm, 1))
    assert len(feed.consumers) == (2 if policy == "seqmoe" else 1)
    checked = []

    class Check(Spy):
        def observe(self, forecast):
            i = [p.spec.layers for p in feed.pset.predictors].index(forecast.layers)
            rows = [r.forecasts[i] for r, _, _ in feed._spans]
            h = min(f.probs.shape[0] for f in rows)
            assert torch.equal(forecast.probs, union_probs(torch.stack([f.probs[:h] for f in rows])))
            checked.append(len(rows))

    feed.consumers = (*feed.consumers, Check())
    got = [s.new for s in generate_batch_ids(lm, PROMPTS, NEW, 3, prefill_tokens=16)]
    assert got == want
    assert max(checked) == 3 and feed.combined == len(checked) and feed.runners == {}
    assert lm.engine.stats.misses > 0


def test_attach_needs_a_forecast_policy(tiny_dirs, random_pset):
    lm = load_offloaded(tiny_dirs[ARCH], residency=0.5, policy="lru", progress=False)
    with pytest.raises(ValueError, match="takes no forecasts"):
        attach_batch_predictor(lm.engine, random_pset(lm, 1))
