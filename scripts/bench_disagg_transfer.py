"""How fast `foveal.disagg.transfer.fetch` moves a payload between two processes on one host.

    python scripts/bench_disagg_transfer.py [--sizes-mb 4 32 128] [--repeats 5] [--tensors 8]

A spawned server process exports one bfloat16 payload per size (split into
`tensors` tensors, like a KV handoff of several layers) with consume=False;
this process fetches each over TCP (peer_host_id forced to another host) and
over shared memory, and prints the median of `repeats` fetches after one
warm-up, in MB/s (MB = 2**20 bytes). The time covers the whole fetch: the
round trip, the copy out and the checksum.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics

import torch

from foveal.disagg.transfer import ExportStore, TransferServer, fetch

MB = 1 << 20


def _serve(sizes_mb: list[int], num_tensors: int, conn) -> None:
    torch.set_num_threads(1)
    store = ExportStore(capacity_bytes=2 * sum(sizes_mb) * MB)
    for size in sizes_mb:
        numel = size * MB // 2 // num_tensors  # bfloat16 elements per tensor
        tensors = {f"layer{i}": torch.randn(numel).to(torch.bfloat16) for i in range(num_tensors)}
        store.put(f"payload{size}", {"size_mb": size}, tensors)
    with TransferServer(store) as server:
        conn.send((server.address, server.host_id))
        conn.recv()  # until the client is done


def _median_seconds(address: str, key: str, peer_host_id: str, size_mb: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats + 1):
        result = fetch(address, [key], timeout_s=60.0, max_bytes=2 * size_mb * MB, peer_host_id=peer_host_id)
        assert result.transport == ("tcp" if peer_host_id == "elsewhere" else "shm")
        samples.append(result.seconds)
    return statistics.median(samples[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[4, 32, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tensors", type=int, default=8)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    server = context.Process(target=_serve, args=(args.sizes_mb, args.tensors, child), daemon=True)
    server.start()
    address, server_host_id = parent.recv()
    print(f"{'size':>8} {'transport':>9} {'median ms':>10} {'MB/s':>8}")
    for size in args.sizes_mb:
        for transport, peer in (("tcp", "elsewhere"), ("shm", server_host_id)):
            seconds = _median_seconds(address, f"payload{size}", peer, size, args.repeats)
            print(f"{size:>6}MB {transport:>9} {seconds * 1e3:>10.1f} {size / seconds:>8.0f}")
    parent.send("done")
    server.join(timeout=10)


if __name__ == "__main__":
    main()
