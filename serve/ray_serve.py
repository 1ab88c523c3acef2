"""`specedge serve --ray --replicas N`: the same app on Ray Serve, one generator per replica.

Ray Serve builds the FastAPI app inside each replica (ingress with a builder function), so every replica
loads the bundle itself and runs its own engine worker; Ray's proxy spreads requests over the replicas.
Each replica holds a model's worth of memory and its own onnxruntime threads: on a small machine give
each one `--threads` so that replicas x threads does not exceed the cores.
"""
from __future__ import annotations

import time

from ..errors import BackendError
from .app import ServerConfig, create_app, listen, load_engine


def build_replica_app(config: ServerConfig):
    """Runs in the replica: load the bundle there, then the app around it."""
    return create_app(config, load_engine(config))


def deployment(config: ServerConfig, replicas: int):
    try:
        from ray import serve
    except ImportError:
        raise BackendError("--ray needs Ray Serve: pip install 'specedge[ray]'") from None
    def builder():  # a plain function: Ray calls it in each replica (a partial would be taken for an app)
        return build_replica_app(config)

    ingress = serve.ingress(builder)()
    # num_cpus=0: replicas are not scheduled by CPU count (onnxruntime threads are set by --threads).
    return serve.deployment(ingress, name="specedge", num_replicas=replicas,
                            ray_actor_options={"num_cpus": 0}, max_ongoing_requests=config.engine.max_queue)


def start(config: ServerConfig, host: str, port: int, replicas: int, blocking: bool = False):
    """Start Ray locally (if no cluster is running) and deploy; returns when the replicas are ready."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": host, "port": port})
    app = deployment(config, replicas).bind()
    serve.run(app, name="specedge", route_prefix="/", blocking=blocking)


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def serve_with_ray(config: ServerConfig, host: str, port: int, replicas: int) -> int:
    # Ray's proxy binds the port in its own actor, and an address it cannot take is only logged there: try it
    # here first, so that an address in use or unknown is one clear error before Ray starts.
    listen(host, port).close()
    start(config, host, port, replicas)
    print(f"specedge: serving {config.model} through Ray Serve ({replicas} replicas) on http://{host}:{port}/v1",
          flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        stop()
    return 0
