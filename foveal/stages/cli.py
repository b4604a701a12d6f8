"""`foveal stage serve --stage NAME --port P [--workers N]`, and the engine-side
stage flags (`add_engine_stage_args` / `stages_config_from_args`) for the
commands that run an engine."""
from __future__ import annotations

import argparse
import json
import sys

from foveal.errors import ConfigError
from foveal.stages import register_stage, stage_names
from foveal.stages.config import StagesConfig, parse_stage_endpoints, parse_stage_workers


def register(subparsers) -> None:
    stage = subparsers.add_parser("stage", help="run a preprocessing stage (pdf, ocr, asr) as a service")
    commands = stage.add_subparsers(dest="stage_command", metavar="COMMAND", required=True)
    serve = commands.add_parser("serve", help="serve one stage over HTTP for --stage-endpoint clients")
    serve.add_argument("--stage", required=True, help=f"stage name: {', '.join(stage_names())}")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8101, help="0 picks a free port (printed)")
    serve.add_argument("--workers", type=int, default=1, help="worker processes for this stage")
    serve.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                       help="stage option, e.g. model=/path/to/whisper (repeatable)")
    serve.add_argument("--target", help="serve an out-of-tree stage class, 'package.module:Class'")
    _add_shared_args(serve)
    serve.set_defaults(func=_serve)


def add_engine_stage_args(parser: argparse.ArgumentParser) -> None:
    """Stage flags for commands that run an engine (`foveal serve`, `foveal chat`)."""
    parser.add_argument("--stage-workers", help="local worker processes per stage, e.g. ocr=2,asr=1")
    parser.add_argument("--stage-endpoint", action="append", default=[], metavar="NAME=URL[,URL]",
                        help="run a stage remotely on these `foveal stage serve` endpoints (repeatable)")
    parser.add_argument("--asr-model", help="faster-whisper (CTranslate2) model folder for speech-to-text")
    parser.add_argument("--max-pdf-pages", type=int, help="most PDF pages per request (default 200)")
    parser.add_argument("--max-pdf-bytes", type=int, help="largest PDF in bytes (default 100 MiB)")
    parser.add_argument("--max-audio-seconds", type=float, help="longest audio clip (default 3600)")
    _add_shared_args(parser)


def stages_config_from_args(args: argparse.Namespace) -> StagesConfig:
    flags = {("asr", "model"): args.asr_model, ("pdf", "max_pages"): args.max_pdf_pages,
             ("pdf", "max_bytes"): args.max_pdf_bytes, ("asr", "max_duration_s"): args.max_audio_seconds}
    options: dict[str, dict] = {}
    for (stage, option), value in flags.items():
        if value is not None:
            options.setdefault(stage, {})[option] = value
    return StagesConfig(workers=parse_stage_workers(args.stage_workers),
                        endpoints=parse_stage_endpoints(args.stage_endpoint),
                        stage_options=options, queue_size=args.stage_queue_size,
                        timeout_s=args.stage_timeout)


def _add_shared_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stage-queue-size", type=int, default=64,
                        help="items waiting per stage before requests get 503")
    parser.add_argument("--stage-timeout", type=float, default=300.0, help="seconds per item")


def _parse_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"--option {pair!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def _serve(args: argparse.Namespace) -> int:
    from foveal.stages.server import StageHTTPServer
    from foveal.stages.service import StagePools

    if args.target:
        register_stage(args.stage, args.target)
    config = StagesConfig(workers={args.stage: args.workers},
                          stage_options={args.stage: _parse_options(args.option)},
                          queue_size=args.stage_queue_size, timeout_s=args.stage_timeout)
    with StagePools(config) as pools:
        server = StageHTTPServer((args.host, args.port), args.stage, pools)
        print(f"foveal stage {args.stage} serving on {server.url}", flush=True, file=sys.stdout)
        try:
            server.serve_forever(poll_interval=0.2)
        finally:
            server.server_close()
    return 0

