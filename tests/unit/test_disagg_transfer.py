"""The disaggregated-serving transfer transport: pack/unpack, ExportStore,
TransferServer + fetch over TCP and shared memory."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

from foveal.disagg.transfer import ExportStore, TransferServer, fetch, host_id, pack, unpack
from foveal.errors import TransferError

MB = 1 << 20
REPO_ROOT = Path(__file__).resolve().parents[2]
DTYPES = [d for d in ("float32", "float16", "bfloat16", "int8", "uint8", "int64", "bool", "float8_e4m3fn",
                      "float8_e5m2", "float4_e2m1fn_x2") if hasattr(torch, d)]


def _tensor(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    """Random bytes of `dtype` (any bit pattern, NaNs included; bools stay 0/1)."""
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    raw = torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8)
    return raw.view(dtype).squeeze(-1)


def _assert_same(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and actual[name].shape == tensor.shape
        expected_bytes = tensor.contiguous().reshape(-1).view(torch.uint8)  # bitwise, so NaNs compare
        assert torch.equal(actual[name].reshape(-1).view(torch.uint8), expected_bytes)


def _segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("foveal_xfer_")}


def _eventually(condition, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def store():
    return ExportStore(capacity_bytes=64 * MB)


@pytest.fixture
def server(store):
    with TransferServer(store) as server:
        yield server


def _fetch(server, keys, shm=False, max_bytes=64 * MB, timeout_s=5.0):
    peer = server.host_id if shm else "other"
    return fetch(server.address, keys, timeout_s=timeout_s, max_bytes=max_bytes, peer_host_id=peer)


def _raw_request(address: str, request: dict | bytes, timeout_s: float = 5.0) -> list[bytes]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(request if isinstance(request, bytes) else json.dumps(request).encode())
    assert sock.poll(int(timeout_s * 1000))
    reply = sock.recv_multipart()
    sock.close()
    return reply


# pack / unpack

@pytest.mark.parametrize("dtype_name", DTYPES)
def test_pack_unpack_round_trips_dtype(dtype_name):
    tensors = {"a": _tensor(getattr(torch, dtype_name)), "b": _tensor(getattr(torch, dtype_name), (7,))}
    meta, out = unpack(pack({"mm_hash": "abc", "n": [1, 2]}, tensors), max_bytes=MB)
    assert meta == {"mm_hash": "abc", "n": [1, 2]}
    _assert_same(tensors, out)


def test_pack_unpack_empty_dict_zero_dim_empty_and_non_contiguous():
    assert unpack(pack({}, {}), max_bytes=0) == ({}, {})
    tensors = {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
               "transposed": torch.arange(12.0).view(3, 4).t(), "strided": torch.arange(20)[::3]}
    assert not tensors["transposed"].is_contiguous()
    _, out = unpack(pack({}, tensors), max_bytes=MB)
    _assert_same(tensors, out)
    assert all(torch.equal(out[name], tensors[name]) for name in tensors)


def test_unpacked_tensors_are_fresh_and_writable():
    source = torch.arange(6.0)
    _, out = unpack(pack({}, {"x": source}), max_bytes=MB)
    out["x"][0] = 100.0
    assert source[0] == 0.0 and out["x"][0] == 100.0


def test_unpack_corrupt_byte_raises():
    frames = pack({}, {"x": torch.arange(100, dtype=torch.int32)})
    data = bytearray(frames[1])
    data[17] ^= 0xFF
    with pytest.raises(TransferError, match="checksum"):
        unpack([frames[0], data], max_bytes=MB)


def test_unpack_truncated_frame_raises():
    frames = pack({}, {"x": torch.arange(100, dtype=torch.int32), "y": torch.ones(3)})
    with pytest.raises(TransferError, match="truncated"):
        unpack([frames[0], bytes(frames[1])[:-1], frames[2]], max_bytes=MB)
    with pytest.raises(TransferError, match="truncated"):
        unpack(frames[:2], max_bytes=MB)


def test_unpack_header_over_max_bytes_raises_before_allocating():
    huge = {"version": 1, "meta": {}, "total_bytes": 1 << 42, "crc32": 0,
            "tensors": [{"name": "x", "dtype": "uint8", "shape": [1 << 42], "nbytes": 1 << 42}]}
    with pytest.raises(TransferError, match="limit"):
        unpack([json.dumps(huge).encode(), b""], max_bytes=MB)
    with pytest.raises(TransferError, match="limit"):
        unpack(pack({}, {"x": torch.zeros(1000)}), max_bytes=3999)


def _header(dtype: str, nbytes: int) -> bytes:
    tensors = [{"name": "x", "dtype": dtype, "shape": [1], "nbytes": nbytes}]
    header = {"version": 1, "meta": {}, "total_bytes": nbytes, "crc32": 0, "tensors": tensors}
    return json.dumps(header).encode()


@pytest.mark.parametrize("header", [b"not json", b"[]", b'{"version": 1}',
                                    _header("float128", 4),  # unknown dtype
                                    _header("float32", 8)],  # shape disagrees with nbytes
                         ids=["not-json", "list", "no-fields", "unknown-dtype", "wrong-nbytes"])
def test_unpack_malformed_header_raises(header):
    with pytest.raises(TransferError):
        unpack([header, b"\0" * 8], max_bytes=MB)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_pack_rejects_unserializable_meta_and_unsupported_dtype():
    with pytest.raises(TransferError, match="JSON"):
        pack({"x": object()}, {})
    with pytest.raises(TransferError, match="dtype"):
        pack({}, {"c": torch.ones(2, dtype=torch.complex32)})


# ExportStore

def test_store_get_is_a_local_read_that_never_consumes(store):
    tensors = {"kv": torch.ones(4)}
    assert store.put("t1", {"n": 1}, tensors, consume=True) == 16
    assert store.get("t1")[0] == {"n": 1} and store.get("t1") is not None
    assert "t1" in store and len(store) == 1 and store.num_bytes == 16
    assert store.get("absent") is None
    store.delete("t1")
    assert "t1" not in store and store.num_bytes == 0


def test_store_ttl_expires_unclaimed_handoffs_and_keeps_caches():
    store = ExportStore(capacity_bytes=MB, ttl_s=0.5)
    store.put("e", {}, {"x": torch.ones(4)}, consume=True)
    store.put("cached", {}, {"x": torch.ones(4)})
    assert "e" in store
    time.sleep(0.6)
    assert "e" not in store and store.get("e") is None and len(store) == 1
    assert "cached" in store and store.num_bytes == 16
    assert store.stats()["num_expired"] == 1


def test_store_evicts_least_recently_used_to_make_room():
    store = ExportStore(capacity_bytes=300)
    for key in ("a", "b", "c"):
        store.put(key, {}, {"x": torch.zeros(25)})  # 100 bytes each
    store.get("a")  # a is now more recent than b
    store.put("d", {}, {"x": torch.zeros(25)})
    assert "b" not in store and all(key in store for key in "acd")
    assert store.stats()["num_evicted"] == 1 and store.num_bytes == 300


def test_store_put_replaces_same_key():
    store = ExportStore(capacity_bytes=150)
    store.put("a", {"v": 1}, {"x": torch.zeros(25)})
    store.put("a", {"v": 2}, {"x": torch.zeros(25)})
    assert store.get("a")[0] == {"v": 2} and store.num_bytes == 100 and store.stats()["num_evicted"] == 0


def test_store_put_over_capacity_raises():
    store = ExportStore(capacity_bytes=100)
    with pytest.raises(TransferError, match="at most 100 bytes"):
        store.put("big", {}, {"x": torch.zeros(26)})
    assert len(store) == 0


# TransferServer + fetch

@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_fetch_several_keys(store, server, shm):
    exports = {f"mm{i}": {"emb": torch.randn(17, 8).to(torch.bfloat16), "pos": torch.arange(17)}
               for i in range(3)}
    for key, tensors in exports.items():
        store.put(key, {"key": key}, tensors)
    result = _fetch(server, list(exports), shm=shm)
    assert result.transport == ("shm" if shm else "tcp")
    assert result.num_bytes == sum(t.nbytes for ts in exports.values() for t in ts.values())
    for key, tensors in exports.items():
        meta, out = result.items[key]
        assert meta == {"key": key}
        _assert_same(tensors, out)


def test_fetch_over_shm_leaves_no_segment(store, server):
    store.put("k", {}, {"x": torch.randn(1000)})
    assert _fetch(server, ["k"], shm=True).transport == "shm"
    assert _eventually(lambda: not _segments())


def test_fetch_consumed_key_twice_raises_and_kept_key_stays(store, server):
    store.put("kv", {}, {"x": torch.ones(3)}, consume=True)
    store.put("emb", {}, {"x": torch.ones(3)})
    _fetch(server, ["kv", "emb"])
    with pytest.raises(TransferError, match="kv"):
        _fetch(server, ["kv"])
    assert "kv" not in store and "emb" in store
    assert _fetch(server, ["emb"], shm=True).items["emb"][1]["x"].sum() == 3
    assert store.stats()["num_fetches"] == 3


def test_fetch_missing_key_is_named_and_consumes_nothing(store, server):
    store.put("kv", {}, {"x": torch.ones(3)}, consume=True)
    with pytest.raises(TransferError, match="never-put"):
        _fetch(server, ["kv", "never-put"])
    assert "kv" in store


def test_fetch_expired_key_raises():
    store = ExportStore(capacity_bytes=MB, ttl_s=0.3)
    store.put("e", {}, {"x": torch.ones(3)}, consume=True)
    with TransferServer(store) as server:
        time.sleep(0.4)
        with pytest.raises(TransferError, match="'e'"):
            _fetch(server, ["e"])


def test_fetch_unreachable_address_raises_within_timeout():
    with socket.socket() as probe:  # a port nobody listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(TransferError, match="no reply"):
        fetch(f"tcp://127.0.0.1:{port}", ["k"], timeout_s=0.5, max_bytes=MB)
    assert time.monotonic() - start < 0.5 + 2


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_fetch_over_max_bytes_raises_and_server_keeps_serving(store, server, shm):
    store.put("big", {}, {"x": torch.zeros(1000)}, consume=True)
    with pytest.raises(TransferError, match="max_bytes"):
        _fetch(server, ["big"], shm=shm, max_bytes=3999)
    assert "big" in store
    assert _fetch(server, ["big"], shm=shm, max_bytes=4000).num_bytes == 4000


def test_server_answers_malformed_requests_and_keeps_serving(store, server):
    store.put("k", {}, {"x": torch.ones(2)})
    for request in (b"\xff garbage", {"op": "fetch"}, {"op": "explode", "keys": [], "max_bytes": 1,
                                                        "transport": "tcp", "host_id": ""}):
        reply = _raw_request(server.address, request)
        assert json.loads(reply[0])["ok"] is False
    assert _fetch(server, ["k"]).num_bytes == 8


def _unacked_shm_request(server, key: str) -> str:
    reply = _raw_request(server.address, {"op": "fetch", "keys": [key], "max_bytes": MB,
                                          "transport": "shm", "host_id": server.host_id})
    envelope = json.loads(reply[0])
    assert envelope["transport"] == "shm" and envelope["segment"] in _segments()
    return envelope["segment"]


def test_shm_fetch_from_another_process_leaves_no_tracker_warning(store, server):
    store.put("k", {}, {"x": torch.arange(1000)})
    client = ("import sys; from foveal.disagg.transfer import fetch; "
              "r = fetch(sys.argv[1], ['k'], timeout_s=10, max_bytes=1 << 20, peer_host_id=sys.argv[2]); "
              "assert r.transport == 'shm' and int(r.items['k'][1]['x'].sum()) == 499500")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", client, server.address, server.host_id],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert "resource_tracker" not in done.stderr and "leaked" not in done.stderr
    assert _eventually(lambda: not _segments())


def test_close_unlinks_unacked_segments(store):
    store.put("k", {}, {"x": torch.ones(100)})
    server = TransferServer(store)
    segment = _unacked_shm_request(server, "k")
    server.close()
    assert segment not in _segments()
    server.close()  # idempotent


def test_unacked_segment_is_unlinked_after_ack_timeout(store):
    store.put("k", {}, {"x": torch.ones(100)})
    with TransferServer(store, shm_ack_timeout_s=0.2) as server:
        segment = _unacked_shm_request(server, "k")
        assert _eventually(lambda: segment not in _segments())


def test_concurrent_fetches_from_four_threads(store, server):
    exports = {f"k{i}": {"x": torch.randn(64, 64), "i": torch.tensor(i)} for i in range(8)}
    for key, tensors in exports.items():
        store.put(key, {}, tensors)
    failures: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            for round_ in range(10):
                keys = [f"k{(index + round_ + j) % 8}" for j in range(3)]
                result = _fetch(server, keys, shm=(index + round_) % 2 == 0)
                for key in keys:
                    _assert_same(exports[key], result.items[key][1])
        except BaseException as error:  # surfaced in the main thread below
            failures.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=15)
    assert not failures and store.stats()["num_fetches"] == 4 * 10 * 3
    assert _eventually(lambda: not _segments())


def test_host_id_is_stable_and_names_this_host():
    assert host_id() == host_id() and socket.gethostname() in host_id()
