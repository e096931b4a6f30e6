"""Replicas on Ray Serve (issue 18): N engine replicas behind one OpenAI-compatible endpoint.

Each replica is a Ray Serve deployment replica (a Ray actor) that loads the model with its own memory plan
(``server.load_for_serving``) and serves the very FastAPI app of ``moe-offload serve`` (``app.create_app``) through
Ray Serve's FastAPI ingress (``serve.ingress()`` + ``__serve_build_asgi_app__``: the app is built inside the
replica, after the model loads). Ray does the rest: its HTTP proxy is the one endpoint, its router sends each
request to the replica with the fewest ongoing requests of two sampled (at most ``max_ongoing_requests`` per
replica, the max batch: more wait in Ray's queue), and its controller calls ``check_health`` on every replica
(the worker thread must be alive) and restarts a replica that fails it.

Two ways to run it:

- ``moe-offload serve --replicas N ...`` (``run_replicas``): starts a local Ray instance and blocks until Ctrl-C;
- ``serve run moe_offload.serve.replicas:build model=testbed replicas=2`` (Ray's own CLI, ``build``), e.g. on a
  Ray cluster started with ``ray start``: the replicas are placed on its nodes (one CPU each, or one GPU each with
  ``device=cuda``).

Ray (``pip install 'moe-offload[replicas]'``) is optional: without it these entry points raise
``MoeOffloadError``.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time

from ..errors import MoeOffloadError

RAY_HINT = "replicas need Ray Serve: pip install 'ray[serve]' (or moe-offload[replicas])"
_TEMP: list[str] = []  # the private Ray instance's temp dirs (removed by stop_replicas)


def _serve():
    try:
        from ray import serve
    except ImportError:
        raise MoeOffloadError(RAY_HINT) from None
    return serve


class EngineReplica:
    """One engine replica: the model, its worker and the server's FastAPI app.

    Args:
        cfg: the replica's ``server.ServeConfig`` as a dict (each replica loads the model itself).
        threads: intra-op CPU threads of this replica (``torch.set_num_threads``; its share of the cores).
    """

    def __init__(self, cfg: dict, threads: int = 1):
        import torch

        from .server import ServeConfig, load_for_serving

        torch.set_num_threads(max(1, threads))
        self.state = load_for_serving(ServeConfig(**cfg))
        self.state.worker.start()  # idempotent: the app's lifespan starts it too

    def __serve_build_asgi_app__(self):
        """The FastAPI app of ``moe-offload serve`` over this replica's model (Ray Serve's ingress calls it)."""
        from .app import create_app

        return create_app(self.state)

    def check_health(self) -> None:
        """Ray Serve's health check: raises RuntimeError when the worker thread is not running."""
        t = getattr(self.state.worker, "_thread", None)
        if t is None or not t.is_alive():
            raise RuntimeError("the engine worker thread is not running")


def application(cfg, replicas: int, cpus_per_replica: float = 1.0):
    """The Ray Serve application of ``replicas`` engine replicas of ``cfg`` (a ``server.ServeConfig``).

    Each replica reserves ``cpus_per_replica`` CPUs (its torch threads) and, with ``device="cuda"``, one GPU;
    ``max_ongoing_requests`` is the max batch (``cfg.max_batch``, default 32).

    Raises:
        MoeOffloadError: Ray Serve is not installed, or ``replicas < 1``.
    """
    if replicas < 1:
        raise MoeOffloadError(f"--replicas must be at least 1, got {replicas}")
    serve = _serve()
    from .batch_memory import DEFAULT_MAX_BATCH

    opts = {"num_cpus": cpus_per_replica, "num_gpus": 1 if cfg.device == "cuda" else 0}
    cls = serve.ingress()(EngineReplica)
    dep = serve.deployment(name="moe-offload", num_replicas=replicas, ray_actor_options=opts,
                           max_ongoing_requests=cfg.max_batch or DEFAULT_MAX_BATCH, health_check_period_s=10,
                           health_check_timeout_s=30)(cls)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    fields["model_dir"] = str(fields["model_dir"])
    fields["progress"] = False
    return dep.bind(fields, max(1, int(cpus_per_replica)))


def build(args: dict):
    """``serve run moe_offload.serve.replicas:build key=value ...``: the application from Ray's CLI arguments.

    Keys: ``model`` (a directory or built-in name, default testbed), ``replicas`` (default 1), ``cpus`` per
    replica (default 1), and any ``server.ServeConfig`` field (``residency``, ``memory_budget_gb``,
    ``max_context``, ``max_batch``, ``device``, ``policy``, ...), as strings.
    """
    from ..testbed.resolve import resolve_model
    from .server import ServeConfig

    args = dict(args)
    model = args.pop("model", None)
    replicas, cpus = int(args.pop("replicas", 1)), float(args.pop("cpus", 1))
    types = {f.name: f.type for f in dataclasses.fields(ServeConfig)}
    kw = {}
    for k, v in args.items():
        if k not in types:
            raise MoeOffloadError(f"unknown option {k!r} (ServeConfig fields: {', '.join(sorted(types))})")
        t = str(types[k])
        kw[k] = int(v) if "int" in t else float(v) if "float" in t else v.lower() == "true" if "bool" in t else v
    cfg = ServeConfig(model_dir=resolve_model(model, progress=False), model_name=kw.pop("model_name", model or
                      "testbed"), **kw)
    return application(cfg, replicas, cpus)


def start_replicas(cfg, replicas: int, host: str, port: int, cpus_per_replica: float = 1.0,
                   num_cpus: int | None = None) -> None:
    """Start a private local Ray instance (its own temp dir, no dashboard) and deploy the replicas, serving
    ``http://host:port/v1``; returns when every replica is up (they load the model in parallel).

    Raises:
        MoeOffloadError: Ray Serve is not installed, or a replica failed to start.
    """
    serve = _serve()
    import ray

    if not ray.is_initialized():
        _TEMP.append(tempfile.mkdtemp(prefix="moe-ray-"))
        ray.init(address="local", num_cpus=num_cpus or max(1, int(replicas * cpus_per_replica)),
                 include_dashboard=False, _temp_dir=_TEMP[-1], log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(application(cfg, replicas, cpus_per_replica), name="moe-offload", route_prefix="/")
    except Exception as e:  # noqa: BLE001 - Ray reports a failed replica constructor as its own exception types
        raise MoeOffloadError(f"the replicas did not start: {str(e).splitlines()[0] if str(e) else type(e)}") from None


def stop_replicas() -> None:
    """Shut Ray Serve and the local Ray instance down and remove its temp dir."""
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    while _TEMP:
        shutil.rmtree(_TEMP.pop(), ignore_errors=True)


def run_replicas(cfg, replicas: int, host: str, port: int) -> None:
    """``moe-offload serve --replicas N``: serve until Ctrl-C (module docstring); each replica gets one CPU."""
    start_replicas(cfg, replicas, host, port)
    print(f"{replicas} replicas on Ray Serve: http://{host}:{port}/v1 (Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        stop_replicas()
