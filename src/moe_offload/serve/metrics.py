"""Prometheus metrics of one server at ``GET /metrics`` (and HEAD), in the text exposition format of
``prometheus_client``.

Two kinds of series, one source of truth each:

* read at scrape time by ``ServeCollector`` from the counters the server already keeps (the worker's
  ``ServerStats``, the engine's ``EngineStats``, the disk store's ``DiskReadStats``, the host cache's
  ``HostCacheStats``, the prefetcher's and the transfer engine's counters, the predictor feed's, the memory plan):
  nothing is counted twice and the hot path is untouched;
* observed by the app where a request ends (``ServeMetrics.finished``) and per HTTP response (``HttpCounter``):
  request counts by endpoint and finish reason / status, and latency histograms.

Every app has its own ``CollectorRegistry`` (several servers in one process do not collide). Names follow the
Prometheus conventions: ``moe_offload_`` prefix, counters end in ``_total``, base units (``_seconds``, ``_bytes``).
Counters read from the engine go down when something resets the engine's counters (``bench.serve_load``,
``bench compare``); Prometheus' ``rate`` treats that as a counter reset.

Memory in use: on CUDA the allocator's bytes; on the CPU, where the slots and the host tiers are the process's own
RAM, the process's resident memory (``prometheus_client``'s ``ProcessCollector`` in every app's registry:
``moe_offload_process_resident_memory_bytes``).
"""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .jobs import SHUTDOWN_CODE, Done, Failed

P = "moe_offload_"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


def _counter(name: str, doc: str, value, labels: dict | None = None) -> CounterMetricFamily:
    """A counter family ``moe_offload_{name}_total`` with one sample (``labels``: label name -> value)."""
    fam = CounterMetricFamily(P + name, doc, labels=list(labels or ()))
    fam.add_metric(list((labels or {}).values()), value)
    return fam


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    """A gauge family ``moe_offload_{name}`` with one unlabelled sample."""
    return GaugeMetricFamily(P + name, doc, value=value)


def _labelled(kind, name: str, doc: str, label: str, values: dict):
    """A counter (``CounterMetricFamily``) or gauge family with one sample per ``{label value: value}``."""
    fam = kind(P + name, doc, labels=[label])
    for k, v in values.items():
        fam.add_metric([str(k)], v)
    return fam


class ServeCollector(Collector):
    """Reads a ``serve.state.ServeState``'s counters at scrape time (module docstring).

    Args:
        state: the served model's ``ServeState`` (its worker, engine and memory plan).
    """

    def __init__(self, state):
        self.state = state

    def collect(self):
        """Every family of this server: requests and tokens, the expert tiers, the slot pool, prefetching and the
        predictor, memory (``prometheus_client`` calls it on each scrape)."""
        yield from request_families(self.state.worker)
        lm = self.state.lm
        yield from expert_families(lm.engine)
        yield from store_families(lm.engine)
        yield from pool_families(lm)
        yield from prefetch_families(lm.engine)
        yield from memory_families(self.state)


def request_families(worker):
    """Tokens counted by the worker (``ServerStats``: requests that ran to the end), running and waiting requests,
    the batch now and at most, and (continuous batching) decode steps per batch size."""
    s = worker.stats
    running = len(worker.running_jobs())
    yield _counter("prompt_tokens", "Prompt tokens of the requests served", s.prompt_tokens)
    yield _counter("generation_tokens", "Tokens generated for the requests served", s.completion_tokens)
    yield _gauge("requests_running", "Requests being generated now", running)
    yield _gauge("requests_waiting", "Requests queued, waiting for the worker", worker.queue_length)
    yield _gauge("batch_size", "Sequences in the decode batch now (1 at most for a batch-1 server)", running)
    yield _gauge("batch_size_max", "Most sequences the server decodes at once", getattr(worker, "max_batch", 1))
    dec = getattr(worker, "decoder", None)
    if dec is not None:
        yield _labelled(CounterMetricFamily, "decode_steps", "Batched decode steps, by sequences in the step",
                        "batch_size", dict(sorted(dec.stats.steps.items())))
        yield _gauge("kv_cache_bytes", "Bytes of the decode batch's KV cache now", dec.kv.nbytes())


def _disk_store(engine):
    """The engine's store when it reads experts from disk (``--host-store disk``, with or without a host cache)."""
    store = getattr(engine, "store", None)
    return store if getattr(store, "mode", None) == "disk" else None


def expert_families(engine):
    """Hits, misses and bytes loaded per tier: ``device`` (``EngineStats``: distinct experts per MoE layer execution
    that were / were not in a slot; bytes copied into slots), ``host_cache`` (``HostCacheStats``: copies served from
    a row / read from disk into one), ``disk`` (expert bytes read); seconds of on-demand copies; a refresh engine's
    host fallback."""
    o = engine.stats
    hits, misses, loaded = {"device": o.hits}, {"device": o.misses}, {"device": o.bytes_loaded}
    store = _disk_store(engine)
    if store is not None:
        loaded["disk"] = store.stats.expert_bytes
        cache = getattr(store, "cache_stats", None)
        if cache is not None:
            hits["host_cache"], misses["host_cache"] = cache.hits, cache.misses
    yield _labelled(CounterMetricFamily, "expert_hits", "Needed experts found in the tier", "tier", hits)
    yield _labelled(CounterMetricFamily, "expert_misses", "Needed experts not found in the tier", "tier", misses)
    yield _labelled(CounterMetricFamily, "expert_loaded_bytes", "Expert bytes loaded: copied into device slots "
                    "(device), read from disk (disk)", "tier", loaded)
    yield _counter("expert_load_seconds", "Seconds spent in on-demand expert copies into the device slots",
                   o.load_time_s)
    if hasattr(o, "host_experts"):  # diffusion refresh engines (TIDE)
        yield _counter("host_fallback_experts", "Experts computed on the host instead of loaded", o.host_experts)
        yield _counter("host_fallback_tokens", "Tokens whose experts were computed on the host", o.host_tokens)


def store_families(engine):
    """The rest of the disk tier (``--host-store disk``: ``DiskReadStats``) and of the host cache in front of it
    (``--host-cache``: ``HostCacheStats``); nothing for a store in host memory."""
    store = _disk_store(engine)
    if store is None:
        return
    st = store.stats
    yield _counter("disk_reads", "Read requests (preadv calls) to the checkpoint files", st.requests)
    yield _counter("disk_read_bytes", "Bytes transferred from disk (aligned spans)", st.bytes_read)
    yield _counter("disk_experts_read", "Experts read from disk", st.experts)
    yield _counter("disk_read_seconds", "Seconds spent in disk reads, summed over the reader threads", st.busy_s)
    cache = getattr(store, "cache_stats", None)
    if cache is None:
        return
    yield _counter("host_cache_bypasses", "Experts read from disk past the host cache (every row pinned)",
                   cache.bypasses)
    yield _counter("host_cache_waits", "Copies that waited for another thread's read of the same expert", cache.waits)
    yield _counter("host_cache_evictions", "Experts evicted from the host cache", cache.evictions)
    yield _gauge("host_cache_rows", "Experts the host cache holds at most", store.rows)
    yield _gauge("host_cache_bytes", "Bytes of the host cache", store.nbytes)


def resident_experts(engine) -> int:
    """Experts in a device slot now: from the slot table (no device access), else (a refresh engine) the device
    lookup table (on CUDA one small device-to-host copy)."""
    table = getattr(engine, "table", None)
    if table is not None:
        return sum(1 for s in list(table.slot_of) if s >= 0)
    return int((engine.pool.lookup >= 0).sum().item())


def pool_families(lm):
    """The device slot pool: slots, experts resident now, routed experts in all, the pool's bytes."""
    pool = lm.engine.pool
    yield _gauge("slots", "Device slots for routed experts", pool.num_slots)
    yield _gauge("resident_experts", "Routed experts in a device slot now", resident_experts(lm.engine))
    yield _gauge("routed_experts", "Routed experts of the model (MoE layers x experts per layer)",
                 lm.num_moe_layers * lm.num_experts)
    yield _gauge("slot_pool_bytes", "Bytes of the device slot pool", pool.num_slots * lm.expert_bytes)


def forecasts(engine) -> int | None:
    """Forecasts the engine's predictor produced (``predictor.runtime``: a ``ForecastFeed``'s or a bare
    ``PredictorRunner``'s predictor calls, a ``LaggedFeed``'s; ``predictor.batch_feed``: combined batch forecasts),
    or None without a predictor."""
    total = None
    for obs in engine.observers:
        if hasattr(obs, "combined"):  # BatchForecastFeed (per-sequence runners come and go)
            n = obs.combined
        else:
            st = getattr(obs, "stats", None) or getattr(getattr(obs, "runner", None), "stats", None)
            if st is None or not hasattr(st, "decode_calls"):
                continue
            n = st.prefill_calls + st.decode_calls
        total = (total or 0) + n
    return total


def prefetch_families(engine):
    """The predictor's forecasts, and prefetch copies where a prefetcher runs: issued (by source: decode forecasts,
    prefill popularity, a refresh plan), landed, waited for while in flight; the transfer engine's copies by
    outcome (prefetches and on-demand loads that went through its queue)."""
    n = forecasts(engine)
    if n is not None:
        yield _counter("predictor_forecasts", "Forecasts the expert predictor produced", n)
    o, pf = engine.stats, engine.prefetcher
    if pf is None:
        if hasattr(o, "prefetches"):  # a refresh engine's planned copies
            yield _counter("prefetches_issued", "Expert prefetch copies issued", o.prefetches,
                           {"source": "refresh_plan"})
        return
    fam = CounterMetricFamily(P + "prefetches_issued", "Expert prefetch copies issued", labels=["source"])
    fam.add_metric(["forecast"], pf.prefetches - pf.prefill_prefetches)
    fam.add_metric(["prefill_popularity"], pf.prefill_prefetches)
    yield fam
    yield _counter("prefetches_landed", "Prefetch copies that landed in their slot", pf.landed)
    yield _counter("prefetches_waited", "Needed experts still in flight that a layer waited for", pf.waited)
    yield _counter("prefetches_wasted", "Prefetched experts evicted before any layer needed them",
                   engine.table.prefetches_wasted)
    t = pf.transfer.stats
    yield _labelled(CounterMetricFamily, "transfer_copies", "Copies through the transfer engine, by outcome",
                    "outcome", {"ok": t.copies, "cancelled": t.cancelled, "failed": t.failed})
    yield _counter("transfer_bytes", "Bytes of the transfer engine's completed copies", t.bytes_copied)


def memory_families(state):
    """The memory plan's budget and parts (bytes), the measured device-tier peak (CUDA: reserved by PyTorch; the CPU
    with ``--track-memory``: static + request peak) and, on CUDA, the bytes reserved now."""
    plan = state.plan
    if plan is not None:
        if plan.budget_bytes is not None:
            yield _gauge("memory_budget_bytes", "The device-tier memory budget", plan.budget_bytes)
        parts = {"non_expert": plan.non_expert_bytes, "lookup": plan.lookup_bytes, "kv_cache": plan.kv_cache_bytes,
                 "activation": plan.activation_bytes, "slot_pool": plan.slot_bytes, "staging": plan.staging_bytes,
                 "host_cache": plan.host_cache_bytes}
        yield _labelled(GaugeMetricFamily, "memory_planned_bytes", "The memory plan's device-tier parts", "part",
                        parts)
    peak = state.memory()["measured"]["device_peak_bytes"]
    if peak is not None:
        yield _gauge("memory_peak_bytes", "Measured device-tier peak since the server started", peak)
    dev = state.lm.device
    if dev.type == "cuda":
        import torch

        yield _gauge("memory_in_use_bytes", "Device memory reserved by PyTorch now", torch.cuda.memory_reserved(dev))


class ServeMetrics:
    """The registry of one app and the instruments the app observes.

    Args:
        state: the ``ServeState`` whose counters ``ServeCollector`` reads.
    Attributes:
        registry: this app's ``CollectorRegistry``.
        http_requests: ``moe_offload_http_requests_total{method, endpoint, status}`` (``HttpCounter``).
        requests: ``moe_offload_requests_total{endpoint, finish_reason}`` of the generation requests.
        ttft, tpot, e2e, queue: histograms (seconds) of the requests that finished, by endpoint.
    """

    def __init__(self, state):
        reg = self.registry = CollectorRegistry(auto_describe=False)
        reg.register(ServeCollector(state))
        ProcessCollector(namespace=P.rstrip("_"), registry=reg)  # ..._process_resident_memory_bytes: in use
        ep = ["endpoint"]
        self.http_requests = Counter(P + "http_requests", "HTTP requests by method, route and status",
                                     ["method", "endpoint", "status"], registry=reg)
        self.requests = Counter(P + "requests", "Generation requests that ended, by endpoint and finish reason "
                                "(stop, length, cancelled, error, shutdown)", ep + ["finish_reason"], registry=reg)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first token (queue wait included)", ep,
                              buckets=TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "Mean time per token after the first, per "
                              "request of at least 2 tokens", ep, buckets=TPOT_BUCKETS, registry=reg)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to the end of the request", ep,
                             buckets=E2E_BUCKETS, registry=reg)
        self.queue = Histogram(P + "request_queue_seconds", "Time waiting for the worker", ep, buckets=E2E_BUCKETS,
                               registry=reg)

    def finished(self, endpoint: str, job, ev) -> None:
        """Count a generation request that ended (``ev``: its ``Done`` or ``Failed`` event; anything else: its
        client went away) and, when it completed, observe its latencies (seconds, from ``job.created``)."""
        if isinstance(ev, Done):
            reason = ev.finish_reason
        elif isinstance(ev, Failed):
            reason = "shutdown" if ev.code == SHUTDOWN_CODE else "error"
        else:
            reason = "cancelled"
        self.requests.labels(endpoint, reason).inc()
        if not isinstance(ev, Done):
            return
        self.e2e.labels(endpoint).observe(time.perf_counter() - job.created)
        self.queue.labels(endpoint).observe(ev.queue_s)
        if job.first_token_at is not None:
            self.ttft.labels(endpoint).observe(job.first_token_at - job.created)
        if len(ev.token_ids) > 1:
            self.tpot.labels(endpoint).observe(ev.decode_s / (len(ev.token_ids) - 1))

    def exposition(self) -> Response:
        """The registry in the Prometheus text format (``GET /metrics``)."""
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class HttpCounter:
    """ASGI middleware counting every HTTP response in ``counter`` by method, route path (``unmatched`` when no
    route matched) and status (500 when the app raised before responding).

    Args:
        app: the ASGI app it wraps. counter: ``ServeMetrics.http_requests``.
    """

    def __init__(self, app, counter: Counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            endpoint = getattr(scope.get("route"), "path", "unmatched")
            self.counter.labels(scope["method"], endpoint, str(status[0])).inc()


def install_metrics(app: FastAPI, state) -> ServeMetrics:
    """Give ``app`` its metrics: a ``ServeMetrics`` (also ``app.state.metrics``), the ``HttpCounter`` middleware
    and the ``GET``/``HEAD /metrics`` route."""
    metrics = app.state.metrics = ServeMetrics(state)
    app.add_middleware(HttpCounter, counter=metrics.http_requests)

    @app.api_route("/metrics", methods=["GET", "HEAD"], include_in_schema=False)
    async def metrics_route():
        return metrics.exposition()

    return metrics
