"""`foveal env`: what this machine gives the engine (CPU features, allocator, native
kernels, GPUs, library versions): the lines to paste into a bug report."""
from __future__ import annotations

import argparse
import json
import sys


def collect() -> dict:
    """The machine as benchmark reports record it, and what the engine made of it."""
    from foveal import allocator
    from foveal.bench.machine import machine_info
    from foveal.kernels.native import native_kernels
    from foveal.layers.linear import describe_linear_layout

    kernels = native_kernels()
    info = {"python": sys.version.split()[0], **machine_info(load=False),
            "allocator_detail": allocator.describe(),
            "native_kernels": (f"{kernels.isa}-bit vectors" + (", int8 VNNI" if kernels.has_int8 else "")
                               if kernels is not None else "none"),
            "linear_layout": describe_linear_layout()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = "not installed"
    return info


def run_env(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0


def register(subparsers) -> None:
    env = subparsers.add_parser(
        "env", help="what this machine gives the engine (CPU, allocator, kernels, GPUs)",
        description="Prints the CPU features the engine reads, the memory allocator this "
                    "process runs on, whether the native decode kernels built, the GPUs and "
                    "the library versions.")
    env.add_argument("--json", action="store_true", help="one JSON object")
    env.set_defaults(func=run_env)
