"""Start-up of ``moe-offload serve``: load the model with a slot pool sized by the memory plan, print the plan,
and run the FastAPI app on uvicorn (in the foreground, or on a background thread for tests and the load test).
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from ..core.policy_spec import PolicySpec, parse_policy, require_predictor
from ..errors import MoeOffloadError
from .batch_memory import plan_batch
from .limits import DEFAULT_MAX_QUEUE, DEFAULT_MAX_REQUEST_BYTES
from .budget import DEFAULT_MAX_CONTEXT, load_within_budget, resolve_budget
from .graph_serving import check_graph_config, compile_decoder
from .memory import MemoryPlan, host_cache_bytes, lookup_bytes, non_expert_bytes, staging_bytes
from .memory_profile import DeviceTierTracker, profile_request



@dataclass
class ServeConfig:
    """What ``moe-offload serve`` was asked for.

    Attributes:
        model_dir: checkpoint directory. model_name: the ``model`` clients pass (default: ``model_dir``).
        device / dtype: as ``generate`` (None: cuda when available / the checkpoint's dtype).
        policy: the policy (a ``core.policy_spec.PolicySpec``; a name is parsed): ``lru``, ``lfu``, ``lfru[-H]``,
            ``prefill-hot``, ``auto``, with ``predictor`` the seqmoe policies; diffusion models also ``reactive``,
            ``tide-fixed[-T<n>]``, ``tide``.
        residency / slots / memory_budget_gb: at most one: slots as a fraction of all routed experts / as a count /
            from a device-tier budget in GB (10^9 bytes). None of them: on CUDA a budget of 90% of the free device
            memory, on the CPU residency 1.0.
        max_context: most tokens (prompt + completion) per request (default min(1024, max_position_embeddings)).
        block_length / steps / threshold: diffusion models (defaults 32 / block length / 0.95).
        prefix_cache: diffusion models: the block-prefix KV cache (default) or the reference loop (False).
        track_memory: on the CPU, measure the device tier during requests (``DeviceTierTracker``; slows decoding).
        progress: progress bars while loading.
        host_store: "pinned", "mmap" or "disk"; host_cache_gb: a host cache in front of the disk (GB;
            ``models.loader.load_offloaded``); pack: an aligned expert pack for the disk store (None: the one beside
            the model, if any).
        max_batch: most sequences decoding together (None: chosen by the memory plan, ``serve.batch_memory``;
            diffusion models and sliding-window / recurrent caches run batch 1).
        predictor: a trained SeqMoE predictor directory for the forecast-driven policies (``seqmoe*``); its
            parameters count as non-expert bytes in the memory plan.
        cors_origins: browser origins allowed to call the API (``app.create_app``; ``("*",)``: any; empty: none).
        max_queue: most requests waiting before new ones get 503 / 529 overloaded (None: no limit; ``serve.limits``).
        max_request_bytes: most bytes of a request body (larger: 413).
        chat_template: a chat template (Jinja text) replacing the model's, or None (``serve --chat-template``).
        response_template: a transformers response template for parsing tool calls, or None (the tokenizer's own,
            else ours: ``serve.tool_formats``).
        graph: decode with graph mode's compiled step, compiled at start (``serve.graph_serving``); graph_backend:
            its compiler backend (``inductor``, default, or ``aot_eager``).
    """

    model_dir: Path
    model_name: str | None = None
    device: str | None = None
    dtype: str | None = None
    policy: PolicySpec = PolicySpec("lru")
    residency: float | None = None
    slots: int | None = None
    memory_budget_gb: float | None = None
    max_context: int | None = None
    block_length: int | None = None
    steps: int | None = None
    threshold: float | None = None
    prefix_cache: bool = True
    track_memory: bool = False
    progress: bool = False
    host_store: str = "pinned"
    host_cache_gb: float | None = None
    pack: str | None = None
    max_batch: int | None = None
    predictor: str | None = None
    cors_origins: tuple[str, ...] = ("*",)
    max_queue: int | None = DEFAULT_MAX_QUEUE
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    chat_template: str | None = None
    response_template: dict | None = None
    graph: bool = False
    graph_backend: str = "inductor"

    def __post_init__(self):
        self.policy = parse_policy(self.policy)


SHUTDOWN_GRACE_S = 2  # seconds a running request gets to finish after Ctrl-C / SIGTERM
LOG_PREFIX = "moe-offload serve: "


def _log(msg: str) -> None:
    print(f"{LOG_PREFIX}{msg}", file=sys.stderr, flush=True)


def log_config() -> dict:
    """uvicorn's logging configuration with every logger (server messages and the access log) on stderr, in the
    same ``moe-offload serve:`` format as the start-up log: the server has one log stream (uvicorn's default puts
    the access log on stdout)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    for handler in cfg["handlers"].values():
        handler["stream"] = "ext://sys.stderr"
    for fmt in cfg["formatters"].values():
        fmt["fmt"] = LOG_PREFIX + fmt["fmt"].replace("%(levelprefix)s ", "%(levelname)s: ")
        fmt["use_colors"] = False
    return cfg


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` that tells the worker first when it is asked to exit (Ctrl-C / SIGTERM): waiting requests
    get a 503 JSON error at once and the running one ``grace_s`` seconds to finish before it ends with that error
    (``Worker.begin_shutdown``), so uvicorn's graceful wait (``grace_s`` + 2 s) never has to cut a request with its
    plain-text 500."""

    def __init__(self, config: "uvicorn.Config", worker, grace_s: float = SHUTDOWN_GRACE_S, on_started=None):
        config.timeout_graceful_shutdown = grace_s + 2
        super().__init__(config)
        self.worker = worker
        self.grace_s = grace_s
        self.on_started = on_started
        self._shutdown_begun = False

    async def startup(self, sockets=None) -> None:
        """uvicorn's start-up, then ``on_started()`` (if given) once the sockets accept connections."""
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    def _shutdown_worker(self) -> None:
        # on its own thread: safe from a signal handler, and the grace period does not block the event loop
        if not self._shutdown_begun:
            self._shutdown_begun = True
            threading.Thread(target=self.worker.begin_shutdown, args=(self.grace_s,), daemon=True,
                             name="moe-offload-shutdown").start()

    def begin_shutdown(self) -> None:
        """Shut down as on Ctrl-C: start the worker's shutdown and ask uvicorn to exit."""
        self._shutdown_worker()
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        """uvicorn's signal handler: begin the worker's shutdown, then uvicorn's own (a second Ctrl-C forces it)."""
        self._shutdown_worker()
        super().handle_exit(sig, frame)


def _diffusion_params(cfg: ServeConfig, arch) -> dict | None:
    from ..generation.diffusion import loop_params

    return loop_params(arch, cfg.block_length, cfg.steps, cfg.threshold, prefix_cache=cfg.prefix_cache)


def load_for_serving(cfg: ServeConfig, log=_log):
    """Load the model for serving and plan its device tier (``serve.memory``); returns a ``state.ServeState``.

    With a budget (``memory_budget_gb``, or the CUDA default): load with a minimal pool (top-k slots), run the
    profile request at ``max_context``, size the pool from the budget, and load again with that pool. Otherwise load
    with the requested slots and profile on it (for the printed plan). The plan is logged line by line.

    Raises:
        MoeOffloadError: a bad checkpoint or option, a policy the server cannot run, ``max_context`` above the
            model's positions, or a budget too small for top-k slots.
    """
    from ..models.loader import read_config, resolve_device
    from .state import ServeState

    path, config, arch = read_config(cfg.model_dir)
    _check_policy(cfg)
    diffusion = _diffusion_params(cfg, arch)
    max_context, given = _context_and_size(cfg, config)
    dev = resolve_device(cfg.device)
    budget, source = resolve_budget(cfg.memory_budget_gb, dev, bool(given))
    block = diffusion["block_length"] if diffusion else None
    load = dict(device=cfg.device, dtype=cfg.dtype, policy=cfg.policy, progress=cfg.progress, host_store=cfg.host_store,
                host_cache_gb=cfg.host_cache_gb, pack=cfg.pack)
    t0 = time.perf_counter()
    if cfg.graph:
        check_graph_config(cfg, diffusion)
        budget = None  # graph mode sizes its pool from --residency / --slots
    if budget is not None:
        lm, pset, batch, note, kv, act, budget = load_within_budget(
            path, budget, source, load, max_context, block, cfg.policy.refresh, cfg.max_batch,
            lambda lm: _load_predictor(cfg, lm), log)
    else:
        lm, pset, batch, note, kv, act = _load_sized(cfg, path, load, max_context, block, log)
        source = _size_source(cfg)
    pred_bytes = 0 if pset is None else pset.parameter_bytes()
    if lm.tokenizer is None:
        raise MoeOffloadError(f"{path} has no tokenizer: cannot encode prompts")
    _apply_templates(lm.tokenizer, cfg, log)
    if pset is not None:
        _attach(lm, pset, batch)
        log(f"predictor {cfg.predictor}: {pred_bytes / 1e6:.1f} MB, forecasts "
            + ("per sequence, one demand per expert for the batch" if batch > 1 else "for one sequence"))
    plan = MemoryPlan(budget, source, non_expert_bytes(lm) + pred_bytes, lookup_bytes(lm), kv, act, lm.expert_bytes,
                      lm.engine.pool.num_slots, lm.num_moe_layers * lm.num_experts, lm.top_k, max_context, batch,
                      staging_bytes(lm), host_cache_bytes(lm))
    for line in plan.lines():
        log(line)
    if note:
        log(f"batch 1: {note}")
    decoder = compile_decoder(lm, cfg, max_context, log) if cfg.graph else None  # before "ready": no request waits
    log(f"ready in {time.perf_counter() - t0:.1f} s: {arch.name}, {lm.device}, {str(lm.dtype).replace('torch.', '')}"
        + (f", block diffusion {diffusion}" if diffusion else ""))
    tracker = DeviceTierTracker(lm.device) if cfg.track_memory and lm.device.type != "cuda" else None
    return ServeState(lm, cfg.model_name or str(cfg.model_dir), max_context, plan, diffusion, tracker, note,
                      cfg.cors_origins, cfg.max_queue, cfg.max_request_bytes, decoder)


def _load_sized(cfg: ServeConfig, path, load: dict, max_context: int, block: int | None, log):
    """The model with its pool sized by ``--residency`` / ``--slots`` (no budget): graph mode's load under
    ``--graph`` (batch 1; its predictor, if any, runs inside the step), else ``load_offloaded`` and the predictor;
    then the profile run at ``max_context`` and the batch plan. Returns ``(lm, pset, batch, note, kv_cache_bytes,
    activation_bytes)``."""
    from ..models.loader import load_offloaded

    if cfg.graph:
        from .graph_serving import load_graph_model

        lm, pset, requested = load_graph_model(cfg, path), None, 1
    else:
        lm = load_offloaded(path, residency=cfg.residency, slots=cfg.slots, **load)
        pset, requested = _load_predictor(cfg, lm), cfg.max_batch
    log(f"profile run: the largest request ({max_context} tokens, sampled)")
    prof = profile_request(lm, max_context, block)
    return (lm, pset, *plan_batch(lm, requested, None, 0, prof, max_context))


def _size_source(cfg: ServeConfig) -> str:
    """Which option sized the slot pool, for the memory plan (no budget)."""
    return ("--slots" if cfg.slots is not None else "--residency" if cfg.residency is not None
            else "--residency 1.0 (default)")


def _apply_templates(tokenizer, cfg: ServeConfig, log) -> None:
    """Give ``tokenizer`` the chat and response templates of ``cfg`` (``--chat-template``, ``--response-template``),
    where given, and say so."""
    if cfg.chat_template is not None:
        tokenizer.chat_template = cfg.chat_template
        log("chat template: the one given (--chat-template)")
    if cfg.response_template is not None:
        tokenizer.response_template = cfg.response_template
        log("tool calls parsed with the response template given (--response-template)")


def _check_policy(cfg: ServeConfig) -> None:
    """Raises MoeOffloadError for a policy the server does not run, or a predictor given without its policy or
    missing for it."""
    if cfg.policy.cross_layer:
        raise MoeOffloadError(f"--policy {cfg.policy} is not served: cross-layer forecasts run in generate and bench "
                              "decode (serve takes seqmoe-cacheonly, seqmoe, seqmoe-infinity with --predictor)")
    require_predictor(cfg.policy, cfg.predictor)
    if cfg.predictor and not cfg.policy.needs_predictor:
        raise MoeOffloadError("--predictor is used by the forecast-driven policies (seqmoe-cacheonly, seqmoe, "
                              f"seqmoe-infinity), not --policy {cfg.policy}")


def _context_and_size(cfg: ServeConfig, config) -> tuple[int, list[str]]:
    """``(max_context, the pool-size options given)``: ``--max-context`` (default: min(DEFAULT_MAX_CONTEXT, the
    model's positions)) checked against the model's ``max_position_embeddings``, and at most one of
    ``--residency``, ``--slots``, ``--memory-budget``.

    Raises:
        MoeOffloadError: ``max_context`` below 2 or above the model's positions, or two pool-size options.
    """
    max_pos = getattr(config, "max_position_embeddings", None)
    max_context = cfg.max_context or min(DEFAULT_MAX_CONTEXT, max_pos or DEFAULT_MAX_CONTEXT)
    if max_context < 2:
        raise MoeOffloadError(f"--max-context must be at least 2, got {max_context}")
    if max_pos and max_context > max_pos:
        raise MoeOffloadError(f"--max-context {max_context} exceeds the model's max_position_embeddings {max_pos}")
    given = [n for n, v in (("--residency", cfg.residency), ("--slots", cfg.slots),
                            ("--memory-budget", cfg.memory_budget_gb)) if v is not None]
    if len(given) > 1:
        raise MoeOffloadError(f"give at most one of --residency, --slots, --memory-budget (got {', '.join(given)})")
    return max_context, given


def _load_predictor(cfg: ServeConfig, lm):
    """``cfg.predictor`` loaded for ``lm`` (a ``predictor.model.PredictorSet``), or None without one.

    Raises:
        MoeOffloadError: the directory is not a predictor of this model (``load_predictor``)."""
    if not cfg.predictor:
        return None
    from ..predictor.model import load_predictor

    return load_predictor(cfg.predictor, model_id=lm.model_id, device=lm.device)


def _attach(lm, pset, batch: int) -> None:
    """Feed the predictor's forecasts to ``lm``'s forecast-driven policy and prefetcher: per sequence and combined
    for a batch (``predictor.batch_feed``), or for the one sequence of a batch-1 server."""
    if batch > 1:
        from ..predictor.batch_feed import attach_batch_predictor

        attach_batch_predictor(lm.engine, pset)
    else:
        from ..predictor.attach import attach_predictor

        attach_predictor(lm.engine, pset)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket bound to ``host:port`` (port 0: a free port).

    Raises:
        MoeOffloadError: the address cannot be bound (in use, not local, permission).
    """
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as e:
        raise MoeOffloadError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def serve_forever(state, sock: socket.socket) -> None:
    """Run the app on uvicorn in the foreground on ``sock`` (from ``bind_socket``) until interrupted (Ctrl-C /
    SIGTERM: see ``GracefulServer``); every log line goes to stderr."""
    from .app import create_app

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(create_app(state), log_level="info", log_config=log_config())
    GracefulServer(config, state.worker, on_started=lambda: _log(
        f"listening on http://{host}:{port} (OpenAI API under /v1; Ctrl-C to stop)")).run(sockets=[sock])


class ServerThread:
    """The app on uvicorn in a background thread, on a loopback socket with a free port (tests, load test).

    Use as a context manager; ``base_url`` is ``http://127.0.0.1:PORT``. Leaving shuts the server down as Ctrl-C
    does (``GracefulServer.begin_shutdown``; its lifespan then stops the worker) and joins the thread.

    Raises:
        MoeOffloadError: the server did not start within ``timeout`` seconds.
    """

    def __init__(self, state, host: str = "127.0.0.1", timeout: float = 30.0):
        from .app import create_app

        self.sock = bind_socket(host, 0)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = GracefulServer(uvicorn.Config(create_app(state), log_level="warning"), state.worker)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.timeout = timeout

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > self.timeout:
                raise MoeOffloadError("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.begin_shutdown()
        self.thread.join(self.timeout)
        self.sock.close()
