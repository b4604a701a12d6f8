"""Where a TP=2 decode step's time goes on this machine: the collectives alone.

    python scripts/bench_tp_comm.py [--hidden 896] [--layers 24] [--vocab 32000] [--batch 8]

Two gloo processes (one thread each, as the mp executor runs them) time the
collectives one decode step of a `layers`-deep decoder issues at batch
`batch`: per layer two all-reduces of (batch, hidden) (attention and MLP
outputs), one for the embedding, and one all-gather of the logits
(batch, vocab / 2). Prints medians of 200 repeats and the step's total, to set
against the measured TPOT (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time(fn, repeats: int) -> float:
    for _ in range(10):
        fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _rank(rank: int, args, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    hidden = torch.randn(args.batch, args.hidden)
    logits = torch.randn(args.batch, args.vocab // 2)
    parts = [torch.empty_like(logits) for _ in range(2)]
    reduce_s = _time(lambda: dist.all_reduce(hidden), args.repeats)
    gather_s = _time(lambda: dist.all_gather(parts, logits), args.repeats)
    if rank == 0:
        results.update(reduce_s=reduce_s, gather_s=gather_s)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(args, port, results), nprocs=2)
    reduces = 2 * args.layers + 1
    step = reduces * results["reduce_s"] + results["gather_s"]
    print(f"cpus: {os.cpu_count()}; batch {args.batch}, hidden {args.hidden}, "
          f"{args.layers} layers, vocab {args.vocab}")
    print(f"all-reduce ({args.batch}, {args.hidden}) fp32: {results['reduce_s'] * 1e3:.3f} ms "
          f"median; x{reduces} per step")
    print(f"all-gather of logits ({args.batch}, {args.vocab // 2}) x2: "
          f"{results['gather_s'] * 1e3:.3f} ms median")
    print(f"collectives per decode step: {step * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
