"""Disaggregated (encode + prefill + decode behind `foveal router`) against
colocated (one mixed server) serving, on the same cores, under a mixed
workload: multi-image requests arriving as a Poisson process, so long
prefills land while other requests decode.

Colocated: one `foveal serve` on all --cpus (OMP_NUM_THREADS = their count).
Disaggregated: the encode and prefill servers share the first --prefill-cpus
cores, the decode server has the rest; the router runs on all of them (it
only relays).
Each layout gets fresh servers, then `foveal bench serve` (the same seeded
workload), then the workers' transfer counters: bytes and seconds of KV and
embedding pulls per request.

    python scripts/bench_disagg.py --model /tmp/small --num-prompts 12 \
        --images-per-prompt 2 --request-rate 0.15 --output-len 48 \
        --goodput ttft:8000 tpot:150 --out /tmp/disagg.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from foveal.bench.machine import machine_info
from foveal.disagg.launch import ServerProcess, metric, start_all

SERVE_FLAGS = ["--max-model-len", "4096", "--preprocess-workers", "1"]


def start_layout(layout: str, model: str, cpus: list[int], num_prefill_cpus: int, logs: Path,
                 extra: list[str]) -> tuple[str, dict[str, ServerProcess]]:
    flags = [*SERVE_FLAGS, *extra]
    if layout == "colocated":
        server = ServerProcess(["serve", model, *flags], logs / "mixed.log", cpus=set(cpus))
        start_all([server], 600)
        return server.url, {"mixed": server}
    first = set(cpus[:num_prefill_cpus])
    rest = set(cpus[num_prefill_cpus:]) or first
    servers = {"encode": ServerProcess(["serve", model, "--role", "encode", *flags],
                                       logs / "encode.log", cpus=first),
               "prefill": ServerProcess(["serve", model, "--role", "prefill", *flags],
                                        logs / "prefill.log", cpus=first),
               "decode": ServerProcess(["serve", model, "--role", "decode", *flags],
                                       logs / "decode.log", cpus=rest)}
    start_all(list(servers.values()), 600)
    router = ServerProcess(["router", "--encode", servers["encode"].url,
                            "--prefill", servers["prefill"].url,
                            "--decode", servers["decode"].url], logs / "router.log",
                           cpus=set(cpus))
    start_all([router], 120)
    servers["router"] = router
    return router.url, servers


def transfer_costs(servers: dict[str, ServerProcess], num_requests: int) -> dict:
    costs = {}
    for role, what in (("decode", "kv"), ("prefill", "embeddings")):
        if role not in servers:
            continue
        url = servers[role].url
        num_bytes = metric(url, "foveal:transfer_bytes_total")
        seconds = metric(url, "foveal:transfer_seconds_total")
        costs[what] = {"pulls": metric(url, "foveal:transfer_pulls_total"),
                       "mib_per_request": num_bytes / num_requests / 2**20,
                       "ms_per_request": 1000 * seconds / num_requests}
    return costs


def run_layout(layout: str, args: argparse.Namespace, logs: Path) -> dict:
    url, servers = start_layout(layout, args.model, args.cpus, args.prefill_cpus, logs,
                                args.serve_args.split())
    try:
        result_path = logs / f"{layout}.json"
        command = [sys.executable, "-m", "foveal", "bench", "serve", "--base-url", url,
                   "--num-prompts", str(args.num_prompts),
                   "--images-per-prompt", str(args.images_per_prompt),
                   "--image-size", args.image_size, "--image-size-range", "0",
                   "--input-len", "20", "--output-len", str(args.output_len),
                   "--request-rate", str(args.request_rate), "--seed", str(args.seed),
                   "--goodput", *args.goodput, "--save-result", str(result_path)]
        subprocess.run(command, check=True)
        result = json.loads(result_path.read_text())
        result["transfer"] = transfer_costs(servers, args.num_prompts)
        return result
    finally:
        for server in servers.values():
            server.stop()


def row(layout: str, result: dict) -> str:
    ttft, itl, tpot = result["ttft_ms"], result["itl_ms"], result["tpot_ms"]
    return (f"| {layout} | {result['completed']}/{result['completed'] + result['failed']} | "
            f"{ttft['median']:.0f} | {ttft['p99']:.0f} | {tpot['median']:.1f} | "
            f"{itl['median']:.1f} | {itl['p99']:.1f} | {result['request_throughput']:.3f} | "
            f"{result['goodput']:.3f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--cpus", type=lambda s: [int(c) for c in s.split(",")],
                        default=sorted(os.sched_getaffinity(0)))
    parser.add_argument("--prefill-cpus", type=int, default=1,
                        help="disaggregated: cores of --cpus for encode + prefill (the rest decode)")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--images-per-prompt", type=int, default=2)
    parser.add_argument("--image-size", default="448x448")
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--request-rate", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goodput", nargs="+", default=["ttft:8000", "tpot:150"])
    parser.add_argument("--serve-args", default="", help="extra flags for every server")
    parser.add_argument("--layouts", nargs="+", default=["colocated", "disaggregated"])
    parser.add_argument("--out", help="write every number here (JSON)")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="foveal-bench-disagg-"))
    results = {layout: run_layout(layout, args, logs) for layout in args.layouts}
    print(f"\nmachine: {machine_info()}\nlogs: {logs}\n")
    print("| layout | done | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ITL p50 ms | ITL p99 ms "
          "| req/s | goodput req/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for layout, result in results.items():
        print(row(layout, result))
    for layout, result in results.items():
        for what, cost in result.get("transfer", {}).items():
            print(f"{layout} {what} transfer: {cost['mib_per_request']:.2f} MiB and "
                  f"{cost['ms_per_request']:.1f} ms per request ({cost['pulls']:.0f} pulls)")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine_info(), "args": vars(args),
                                              "results": results}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
