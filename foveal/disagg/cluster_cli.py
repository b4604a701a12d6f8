"""`foveal cluster`: disaggregated serving on Ray. The router runs in this
process; each worker server is a Ray actor on some node of the cluster and
joins the router's pool by itself, e.g.

    ray start --head                                  # on the first host
    ray start --address HEAD_IP:6379                  # on each other host
    foveal cluster /models/qwen2-vl --encode 1 --prefill 2 --decode 4 \\
        --ray-address auto --host 0.0.0.0 --num-cpus-per-worker 8 --num-gpus-per-worker 1

Without --ray-address (or RAY_ADDRESS) a local Ray instance is started. On more
than one host, listen on an address the other hosts reach (--host 0.0.0.0: the
workers are given this node's IP) and keep the model at the same path on every
host. Ctrl-C stops the workers (they leave the pool), then the router.
"""
from __future__ import annotations

import argparse
import shlex
import threading
import time

from foveal.errors import ConfigError
from foveal.logger import init_logger

logger = init_logger(__name__)

_WILDCARD_HOSTS = ("0.0.0.0", "::", "")
_PRUNE_INTERVAL_S = 10.0


class RouterThread:
    """An ASGI app (the router) under uvicorn in a background thread of this process."""

    def __init__(self, app, host: str, port: int, startup_timeout_s: float = 30.0) -> None:
        import uvicorn

        self.host, self.startup_timeout_s = host, startup_timeout_s
        config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="foveal-router", daemon=True)
        self.port = port

    def __enter__(self) -> RouterThread:
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.__exit__()
                raise ConfigError(f"the router did not start listening on {self.host}:{self.port} "
                                  f"within {self.startup_timeout_s:g} s; is the port in use (--port)?")
            time.sleep(0.05)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]  # port 0: the one chosen
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)

    @property
    def url(self) -> str:
        """The URL workers reach the router at (a wildcard host: this node's IP)."""
        host = self.host
        if host in _WILDCARD_HOSTS:
            import ray

            host = ray.util.get_node_ip_address()
        return f"http://{host}:{self.port}"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "cluster", help="disaggregated serving on Ray: a router and its workers as Ray actors",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (the same path on every node)")
    for role in ("encode", "prefill", "decode"):
        parser.add_argument(f"--{role}", type=int, default=0, metavar="N",
                            help=f"{role} workers to start (default 0)")
    parser.add_argument("--ray-address", help="the Ray cluster to join (auto, HOST:6379; "
                                              "default: RAY_ADDRESS, else a local instance)")
    parser.add_argument("--host", default="127.0.0.1", help="the router's interface")
    parser.add_argument("--port", type=int, default=8080, help="the router's port")
    parser.add_argument("--num-cpus-per-worker", type=float, default=1.0,
                        help="CPUs Ray reserves for each worker (also its torch threads)")
    parser.add_argument("--num-gpus-per-worker", type=float, default=0.0,
                        help="GPUs Ray reserves for each worker")
    parser.add_argument("--serve-args", default="",
                        help="more `foveal serve` flags for every worker, as one string, e.g. "
                             "\"--max-model-len 4096 --kv-cache-memory-bytes 2000000000\" (one flag alone: "
                             "--serve-args=--flag)")
    parser.add_argument("--startup-timeout", type=float,
                        help="seconds for the workers to start and join (default: "
                             "FOVEAL_WORKER_STARTUP_TIMEOUT_S, 600)")
    parser.set_defaults(func=run_cluster)


def _roles(args: argparse.Namespace) -> list[str]:
    counts = {role: getattr(args, role) for role in ("encode", "prefill", "decode")}
    if any(count < 0 for count in counts.values()) or counts["decode"] < 1:
        raise ConfigError(f"worker counts {counts}: each must be >= 0, and --decode >= 1 "
                          "(decode workers answer the clients)")
    return [role for role, count in counts.items() for _ in range(count)]


def run_cluster(args: argparse.Namespace) -> int:
    """Serves until interrupted, then stops the workers and the router."""
    from foveal.disagg.ray_cluster import RayCluster, check_serve_args
    from foveal.disagg.router import RouterConfig, build_router_app

    roles = _roles(args)
    serve_args = tuple(shlex.split(args.serve_args))
    check_serve_args(serve_args)
    with RouterThread(build_router_app(RouterConfig()), args.host, args.port) as router:
        cluster = RayCluster(args.model, router.url, serve_args=serve_args,
                             ray_address=args.ray_address,
                             num_cpus_per_worker=args.num_cpus_per_worker,
                             num_gpus_per_worker=args.num_gpus_per_worker,
                             startup_timeout=args.startup_timeout)
        try:
            cluster.add_workers(roles)
            print(f"router: {router.url}", flush=True)
            for worker in cluster.workers():
                print(f"  {worker.role:<8} {worker.url}", flush=True)
            while True:
                time.sleep(_PRUNE_INTERVAL_S)
                for worker in cluster.prune_dead():
                    logger.warning("%s worker %s died and left the pool; start a new one "
                                   "(the cluster does not restart workers)", worker.role, worker.url)
        except KeyboardInterrupt:
            pass
        finally:
            cluster.shutdown()
    return 0
