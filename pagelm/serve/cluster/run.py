"""`pagelm serve MODEL --replicas N [--ray-address ADDR]`: start or join Ray, deploy the
application, answer until interrupted, then take the application down (and a local Ray with it).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace

from pagelm.errors import PagelmError
from pagelm.serve.core import ServeSettings
from pagelm.serve.cluster import APP_NAME, require_ray
from pagelm.serve.cluster.loopback import LOOPBACK_ENV, NICENESS_ENV, start_local_ray

def replica_cpus(ray, replicas: int, threads: int | None) -> int:
    """CPUs per replica: --threads when given, else an equal share of the cluster, no more than
    the largest node has (a replica runs on one node)."""
    if threads is not None:
        return threads
    nodes = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")]
    total = sum(nodes)
    return max(1, min(int(total // replicas), int(max(nodes, default=1))))


def stop_on_signals() -> threading.Event:
    """An event the first SIGINT or SIGTERM sets: shut down, letting running generations finish.
    A second one raises KeyboardInterrupt where the main thread is (waiting for them in
    `serve.delete`), so the local Ray is shut down at once."""
    stop = threading.Event()

    def handle(signum: int, frame) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print("pagelm serve: interrupted; again to stop without waiting for running generations",
              file=sys.stderr, flush=True)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)
    return stop


def serve_cluster(settings: ServeSettings, replicas: int, ray_address: str | None, host: str, port: int,
                  niceness: int | None = None) -> int:
    local = ray_address is None
    if local:
        os.environ.update(LOOPBACK_ENV)  # before ray is imported
    serve = require_ray()
    import ray

    from pagelm.serve.cluster.deployments import build_app

    if replicas < 1:
        raise PagelmError(f"--replicas must be >= 1, got {replicas}")
    # replicas start in other working directories, maybe on other nodes: paths must be absolute
    settings = replace(settings, model_path=os.path.abspath(settings.model_path),
                       mmproj=settings.mmproj and os.path.abspath(settings.mmproj))
    if niceness is not None and not local:
        raise PagelmError("--replica-niceness applies to a local Ray; a joined cluster's workers run at its "
                          f"own {NICENESS_ENV}")
    started = time.monotonic()
    if local:
        address = start_local_ray(niceness=niceness)
        _progress(f"local Ray at {address} (workers at nice {os.environ[NICENESS_ENV]})", started)
    else:
        ray.init(address=ray_address, logging_level=logging.WARNING)
    stop = stop_on_signals()
    try:
        cpus = replica_cpus(ray, replicas, settings.threads)
        serve.start(http_options={"host": host, "port": port})
        _progress("Serve started", started)
        print(f"pagelm serve: deploying {replicas} replica(s) of {settings.model_path}, {cpus} CPU(s) each "
              f"({'local Ray' if local else 'Ray at ' + ray_address})", file=sys.stderr, flush=True)
        serve.run(build_app(settings, replicas, cpus), name=APP_NAME, route_prefix="/")
        _progress("replicas healthy", started)
        print(f"pagelm serve: {settings.model_name} ready on http://{host}:{port} ({replicas} replicas)",
              file=sys.stderr, flush=True)
        stop.wait()
    finally:
        print("pagelm serve: shutting down (running generations may finish)", file=sys.stderr, flush=True)
        try:
            serve.delete(APP_NAME)
            if local:
                serve.shutdown()
        finally:
            ray.shutdown()
    return 0


def _progress(what: str, started: float) -> None:
    print(f"pagelm serve: {what} ({time.monotonic() - started:.1f} s)", file=sys.stderr, flush=True)
