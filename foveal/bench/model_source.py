"""Where an offline benchmark gets its checkpoint: --model DIR or --dummy PRESET
(random weights, built once into the cache)."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_model_source_args(parser: argparse.ArgumentParser, default_dummy: str | None = None,
                          default_model: Path | None = None) -> None:
    """--model DIR | --dummy PRESET, shared by every offline benchmark; with a
    default (a preset or a folder) neither flag is required."""
    source = parser.add_mutually_exclusive_group(
        required=default_dummy is None and default_model is None)
    source.add_argument("--model", help="Hugging Face checkpoint folder"
                        + (f" (default: {default_model})" if default_model else ""))
    source.add_argument("--dummy", metavar="PRESET", default=default_dummy,
                        help="random-weight checkpoint of a preset (tiny-qwen2-vl, "
                             "tiny-qwen2.5-vl, small, ...), built once into the cache")
    parser.set_defaults(default_model=default_model)


def model_dir_from_args(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    if not args.dummy:
        return Path(args.default_model)
    from foveal.entrypoints.demo import default_cache_dir
    from foveal.loader.tiny_model import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(default_cache_dir() / args.dummy, args.dummy)
