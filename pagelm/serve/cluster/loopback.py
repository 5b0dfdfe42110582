"""A local Ray that listens on 127.0.0.1 only: the environment that makes Ray bind and announce
loopback addresses, the cluster's start, and the one listener Serve binds on every interface.
"""

from __future__ import annotations

import logging
import os

from pagelm.errors import PagelmError

LOOPBACK = "127.0.0.1"  # a local Ray of one node listens on this machine only
# Ray's switch for a cluster of one machine: every address it binds or announces is 127.0.0.1
# (read when ray is first imported, and by each process it starts)
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
NICENESS_ENV = "RAY_worker_niceness"  # Ray's own setting; Ray's default is 15


def start_local_ray(num_cpus: int | None = None, niceness: int | None = None) -> str:
    """Start a Ray of this machine alone, every listener on 127.0.0.1, dashboard off; its workers
    (the replicas among them) at `niceness` (None: RAY_worker_niceness if set, else 0, the
    niceness of a single `pagelm serve`). Returns the cluster's address."""
    os.environ.update(LOOPBACK_ENV)
    if niceness is not None:
        os.environ[NICENESS_ENV] = str(niceness)
    else:
        os.environ.setdefault(NICENESS_ENV, "0")
    import ray

    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING, _node_ip_address=LOOPBACK)
    address = ray.get_runtime_context().gcs_address
    if not address.startswith(LOOPBACK + ":"):
        ray.shutdown()
        raise PagelmError(f"the local Ray announced {address}, not {LOOPBACK}: ray was imported before "
                          f"{', '.join(LOOPBACK_ENV)} was set")
    return address


def keep_replica_on_loopback() -> None:
    """Serve starts each replica's inter-deployment gRPC server on every interface ("[::]:0", with
    no setting to change it) once the replica's constructor has run. Called from the constructor:
    on a node whose address is 127.0.0.1 (a local Ray), bind it to 127.0.0.1 like the rest."""
    import ray
    from ray.serve._private import replica

    if ray.util.get_node_ip_address() != LOOPBACK or getattr(replica.add_port_to_grpc_server, "loopback", False):
        return
    bind = replica.add_port_to_grpc_server

    def bind_loopback(server, address: str):
        return bind(server, address.replace("[::]", LOOPBACK, 1))

    bind_loopback.loopback = True
    replica.add_port_to_grpc_server = bind_loopback
