"""`foveal serve [MODEL]`: the OpenAI-compatible HTTP server over AsyncLLM.
Without MODEL it serves the shipped demo model (foveal/assets/demo_model).
Besides the engine flags: server flags (names, keys and limits, media fetching, the default
visual-token budget) and the preprocessing stage flags (--stage-workers, ...)."""
from __future__ import annotations

import argparse
from pathlib import Path

from foveal.demo_model import DEMO_MODEL_NAME
from foveal.entrypoints.cli_args import add_engine_args, engine_kwargs
from foveal.entrypoints.security_args import add_security_args, security_config_from_args
from foveal.errors import ConfigError
from foveal.stages.cli import add_engine_stage_args, stages_config_from_args



def _model_dir(model: str | None) -> str:
    if model:
        return model
    from foveal.demo_model import default_model_dir

    return str(default_model_dir())


def server_config(args: argparse.Namespace, model_dir: str):
    """The API-side options (names, key, media fetching, stages) from parsed flags."""
    from foveal.entrypoints.openai.serving_engine import ServerConfig
    from foveal.multimodal.media.fetch import MediaFetchConfig

    if args.media_fetch_timeout <= 0 or args.max_media_bytes <= 0:
        raise ConfigError("--media-fetch-timeout and --max-media-bytes must be > 0")
    local_root = args.allowed_local_media_path
    if local_root and not Path(local_root).is_dir():
        raise ConfigError(f"--allowed-local-media-path {local_root!r} is not a folder")
    names = tuple(args.served_model_name or [args.model or DEMO_MODEL_NAME])
    domains = None if args.allowed_media_domains is None else tuple(args.allowed_media_domains)
    media = MediaFetchConfig(timeout_s=args.media_fetch_timeout,
                             max_bytes=args.max_media_bytes,
                             allowed_local_media_path=local_root,
                             allowed_media_domains=domains,
                             allow_private_media_urls=args.allow_private_media_urls)
    return ServerConfig(served_model_names=names, model_path=model_dir,
                        security=security_config_from_args(args),
                        media=media, stages=stages_config_from_args(args),
                        playground=not args.no_playground)


def serve_engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine flags, with --max-visual-tokens as the default planner budget
    (a request's mm_processor_kwargs.max_visual_tokens overrides it)."""
    kwargs = engine_kwargs(args)
    kwargs.update({key: getattr(args, flag) for flag, key in _TRANSFER_FLAGS.items()})
    if args.max_visual_tokens is not None:
        if args.max_visual_tokens < 1:
            raise ConfigError(f"--max-visual-tokens {args.max_visual_tokens}: must be >= 1")
        kwargs["mm_processor_kwargs"] = {**kwargs["mm_processor_kwargs"],
                                         "max_visual_tokens": args.max_visual_tokens}
    return kwargs


def run_serve(args: argparse.Namespace) -> int:
    from foveal.async_engine import AsyncLLM
    from foveal.engine_args import EngineArgs
    from foveal.entrypoints.openai.api_server import serve

    if args.preprocess_workers < 1 or args.max_pending_requests < 1:
        raise ConfigError("--preprocess-workers and --max-pending-requests must be >= 1")
    model_dir = _model_dir(args.model)
    config = server_config(args, model_dir)
    engine_args = EngineArgs.from_kwargs(model_dir, **serve_engine_kwargs(args))
    engine = AsyncLLM(engine_args, preprocess_workers=args.preprocess_workers,
                      max_pending_requests=args.max_pending_requests, stages=config.stages,
                      restart_failed_core=args.on_engine_failure == "restart",
                      core_hang_timeout_s=args.engine_hang_timeout)
    services = ()
    if args.router:
        from foveal.disagg.registration import RouterRegistration

        role = "decode" if args.role == "mixed" else args.role
        services = (RouterRegistration(args.router, role, f"http://{args.host}:{args.port}",
                                       args.router_api_key),)
    return serve(engine, config, args.host, args.port, services)


_TRANSFER_FLAGS = {"role": "role", "transfer_host": "transfer_host",
                   "transfer_advertise_host": "transfer_advertise_host",
                   "transfer_port": "transfer_port", "transfer_buffer_bytes": "transfer_buffer_bytes",
                   "transfer_ttl": "transfer_ttl_s", "transfer_timeout": "transfer_timeout_s",
                   "kv_load_failure_policy": "kv_load_failure_policy"}


def add_disagg_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("disaggregated serving (foveal router)")
    group.add_argument("--role", choices=["mixed", "encode", "prefill", "decode"], default="mixed",
                       help="encode: vision tower only, exports embeddings; prefill / decode: "
                            "export / import a prompt's KV when a router asks; mixed: whole "
                            "requests (also honours transfer requests)")
    group.add_argument("--router", metavar="URL",
                       help="join this router's pool for --role at startup, leave it at exit "
                            "(a mixed server joins the decode pool)")
    group.add_argument("--router-api-key", help="the router's --api-key, if it has one")
    group.add_argument("--transfer-host", default="127.0.0.1",
                       help="interface the transfer server (KV, embeddings) listens on")
    group.add_argument("--transfer-advertise-host",
                       help="host name peers dial for transfers (default: --transfer-host)")
    group.add_argument("--transfer-port", type=int, default=0, help="0: any free port")
    group.add_argument("--transfer-buffer-bytes", type=int, default=2 << 30,
                       help="bytes of exports (KV, embeddings) held for peers")
    group.add_argument("--transfer-ttl", type=float, default=120.0,
                       help="seconds an unclaimed KV export is kept")
    group.add_argument("--transfer-timeout", type=float, default=30.0,
                       help="seconds one pull from a peer may take")
    group.add_argument("--kv-load-failure-policy", choices=["recompute", "fail"],
                       default="recompute",
                       help="a pull that fails: compute it here, or fail the request (503)")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    add_security_args(server)
    server.add_argument("--no-playground", action="store_true",
                        help="do not serve the web playground at /")
    server.add_argument("--served-model-name", nargs="+",
                        help="name(s) clients send as 'model' (default: MODEL as given)")
    server.add_argument("--allowed-local-media-path", metavar="DIR",
                        help="allow file:// image and video URLs under DIR (off by default)")
    server.add_argument("--allowed-media-domains", nargs="+", metavar="HOST",
                        help="fetch http(s) media only from these hosts (exact names, "
                             "subdomains not implied), whatever address they resolve to")
    server.add_argument("--allow-private-media-urls", action="store_true",
                        help="let media URLs reach loopback, private and link-local addresses "
                             "(refused by default; for trusted networks)")
    server.add_argument("--preprocess-workers", type=int, default=2,
                        help="processes decoding and resizing media")
    server.add_argument("--max-pending-requests", type=int, default=256,
                        help="requests queued before the server answers 503")
    server.add_argument("--on-engine-failure", choices=["exit", "restart"], default="exit",
                        help="when the engine core process dies or hangs (its requests get "
                             "503): exit with code 1, or start a new core and serve again")
    server.add_argument("--engine-hang-timeout", type=float, default=300.0,
                        help="seconds the engine core may answer nothing (one step's limit) "
                             "before it counts as hung and is killed")
    server.add_argument("--media-fetch-timeout", type=float, default=10.0,
                        help="seconds to fetch one image or video URL")
    server.add_argument("--max-media-bytes", type=int, default=20 * 1024 * 1024,
                        help="largest image or video a client may send or name, in bytes")
    server.add_argument("--max-visual-tokens", type=int,
                        help="default visual-token budget per request: images and videos are "
                             "downsampled to fit (per request: mm_processor_kwargs)")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve MODEL (a Hugging Face checkpoint folder) over the OpenAI API: "
                    "/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics. "
                    "Without MODEL, serves the shipped demo model.")
    parser.add_argument("model", nargs="?", help="checkpoint folder (default: the shipped demo model)")
    add_server_args(parser)
    add_engine_args(parser)
    add_disagg_args(parser)
    add_engine_stage_args(parser.add_argument_group("preprocessing stages (PDF, OCR, ASR)"))
    parser.set_defaults(func=run_serve)
