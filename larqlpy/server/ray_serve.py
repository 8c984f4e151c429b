"""`larqlpy serve` on Ray Serve: N replicas, each the whole server (server/ray_replica.py), behind the
front in this process (server/ray_front.py) that routes each request to the replica holding its
conversation's state (server/ray_router.py).

Ray is optional (`pip install 'larqlpy[ray]'`); this module is imported only when `--ray` is given.
"""

from __future__ import annotations

import signal
import threading

import uvicorn
from ray import serve
from ray.serve.config import RequestRouterConfig

from larqlpy.batch.local import Setup
from larqlpy.batch.ray import connect
from larqlpy.config import ServeConfig, default_parallel
from larqlpy.server.bind import listen
from larqlpy.server.ray_front import Front
from larqlpy.server.ray_replica import Replica
from larqlpy.server.ray_router import StateRouter
from larqlpy.server.scaling import Scale

APP = "larqlpy"
# the replica's app on Ray Serve's own event loop: no hand-over between threads for each event
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def deployment_options(cfg: ServeConfig, scale: Scale) -> dict:
    """The replicas' Ray Serve options: their CPUs, how many, the router, and as many requests at
    once as one server takes before it answers 429 (its live slots and its queue), and the front's
    channel."""
    slots = cfg.parallel or default_parallel(scale.replica_cpus)
    if scale.autoscaled:  # more when a replica's requests pass what it decodes together: they queue
        lo, hi = scale.bounds
        scaling = {"autoscaling_config": {"min_replicas": lo, "max_replicas": hi,
                                          "initial_replicas": min(max(scale.replicas, lo), hi),
                                          "target_ongoing_requests": slots}}
    else:
        scaling = {"num_replicas": scale.replicas}
    return {"ray_actor_options": {"num_cpus": scale.replica_cpus, "runtime_env": {"env_vars": REPLICA_ENV}},
            "max_ongoing_requests": slots + cfg.queue_size + 1,
            "graceful_shutdown_timeout_s": cfg.shutdown_grace_s + 5,
            "request_router_config": RequestRouterConfig(request_router_class=StateRouter), **scaling}


def application(setup: Setup, cfg: ServeConfig, scale: Scale):
    return serve.deployment(Replica).options(name="replica", **deployment_options(cfg, scale)).bind(setup, cfg)


def serve_on_ray(address: str, setup: Setup, cfg: ServeConfig, scale: Scale, announce=None) -> None:
    """Deploy on the cluster at `address` ("local": one started here with the CPUs the replicas
    take) and serve HTTP from this process until SIGTERM / Ctrl-C; then the application is deleted
    (each replica drains and saves its states) and a local cluster stopped."""
    sock = listen(cfg.host, cfg.port)  # a busy port is refused before anything starts
    ray, _ = connect(address, scale.most() * scale.replica_cpus)
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn raises the signal again when it is done: a no-op
        signal.signal(sig, lambda *_: None)
    try:
        serve.start(proxy_location="Disabled")
        front = Front(serve.run(application(setup, cfg, scale), name=APP, route_prefix=None), cfg.max_body_bytes)
        if announce is not None:
            announce({"replicas": scale.replicas, "url": f"http://{cfg.host}:{cfg.port}", "address": address,
                      "cluster": ray.get_runtime_context().gcs_address, "state_dir": cfg.state_dir})
        uvicorn.Server(uvicorn.Config(front.app(), log_level="warning", access_log=False, http="h11",
                                      loop="asyncio")).run(sockets=[sock])
        # each replica drains (its requests in flight finish) and saves; bounded, since a signal sent to
        # the terminal's process group also reaches a local cluster's own processes
        deleting = threading.Thread(target=serve.delete, args=(APP,), daemon=True)
        deleting.start()
        deleting.join(timeout=cfg.shutdown_grace_s + 30)
    finally:
        sock.close()
        if address == "local":
            ray.shutdown()
