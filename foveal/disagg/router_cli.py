"""`foveal router`: the front of disaggregated serving. It sends each request
through encode, prefill and decode workers (`foveal serve --role ...`), e.g.

    foveal router --encode http://10.0.0.1:8001 --prefill http://10.0.0.2:8002 \\
        --decode http://10.0.0.3:8003 http://10.0.0.4:8003 --port 8080

Pools may start empty; workers join and leave at runtime through
POST / DELETE /router/workers {"role": ..., "url": ...}.
"""
from __future__ import annotations

import argparse

from foveal.entrypoints.security_args import add_security_args, security_config_from_args


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "router", help="route requests across encode / prefill / decode workers",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for role in ("encode", "prefill", "decode"):
        parser.add_argument(f"--{role}", nargs="+", action="extend", default=[], metavar="URL",
                            help=f"base URLs of the {role} pool's workers (repeatable; may be empty)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds a whole request may take, stream included")
    parser.add_argument("--stage-timeout", type=float, default=300.0,
                        help="seconds a stage may wait for a worker's answer (per streamed chunk)")
    parser.add_argument("--connect-timeout", type=float, default=5.0,
                        help="seconds to connect to a worker; also the health-check timeout")
    parser.add_argument("--health-interval", type=float, default=2.0,
                        help="seconds between health checks of every worker")
    parser.add_argument("--remove-after", type=float, default=30.0,
                        help="remove a worker that has failed health checks this many seconds")
    parser.add_argument("--max-attempts", type=int, default=2,
                        help="workers tried per stage before answering 503")
    parser.add_argument("--cache-load-slack", type=int, default=4,
                        help="in-flight requests a cache-holding worker may exceed the least "
                             "loaded one by and still be chosen")
    parser.add_argument("--cache-entries", type=int, default=100_000,
                        help="cache keys remembered per pool (LRU)")
    add_security_args(parser)  # --api-key (repeatable), --rate-limit-rpm, ...
    parser.set_defaults(func=run_router)


def router_config(args: argparse.Namespace):
    """The RouterConfig of parsed flags (ConfigError names the flag to change)."""
    from foveal.disagg.pools import normalize_worker_url
    from foveal.disagg.router import RouterConfig

    urls = {role: tuple(normalize_worker_url(url) for url in getattr(args, role))
            for role in ("encode", "prefill", "decode")}
    return RouterConfig(**urls, request_timeout_s=args.request_timeout,
                        stage_timeout_s=args.stage_timeout, connect_timeout_s=args.connect_timeout,
                        health_interval_s=args.health_interval, remove_after_s=args.remove_after,
                        max_attempts=args.max_attempts, cache_load_slack=args.cache_load_slack,
                        cache_entries=args.cache_entries,
                        security=security_config_from_args(args))


def run_router(args: argparse.Namespace) -> int:
    """Serves until interrupted."""
    import uvicorn

    from foveal.disagg.router import build_router_app

    uvicorn.run(build_router_app(router_config(args)), host=args.host, port=args.port,
                log_level="info", timeout_keep_alive=5)
    return 0
