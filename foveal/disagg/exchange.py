"""The API-process side of disaggregated transfers: what a request asks to
pull or export, the pulls (run in the preprocessing workers, next to the rest
of a request's CPU work), and this engine's exports served to its peers.

Parameters, as the router passes them in request bodies:
  to a prefill worker   kv_transfer_params {"do_remote_decode": true}
  from it               kv_transfer_params {"address", "host_id", "transfer_id",
                        "num_tokens", "digest", "layout"}   (give these to decode)
  from an encode worker ec_transfer_params {"address", "host_id",
                        "items": {mm_hash: rows}}           (give these to prefill)
A pull checks what it got against the request the puller built itself: the
prompt digest (token ids and media hashes) and the KV layout for KV, rows and
width for embeddings; any mismatch is a TransferError.
"""
from __future__ import annotations

import hashlib
import threading
import time
import uuid
from dataclasses import dataclass, field

from foveal.config import EngineConfig, TransferConfig
from foveal.engine.kv_groups import kv_cache_groups
from foveal.engine.request import KVImport, Request
from foveal.errors import InvalidRequestError, TransferError
from foveal.logger import init_logger
from foveal.multimodal.inputs import ENCODED_KEY

logger = init_logger(__name__)


@dataclass
class TransferRequest:
    """What one request asks of transfers (parsed from its body)."""

    export_kv: bool = False  # prefill: export the prompt's KV for a decode worker
    kv_source: dict | None = None  # decode: where the prompt's KV waits
    ec_source: dict | None = None  # prefill: where media embeddings wait

    def __bool__(self) -> bool:
        return self.export_kv or self.kv_source is not None or self.ec_source is not None


@dataclass
class TransferStats:
    num_bytes: int = 0
    seconds: float = 0.0
    num_pulls: int = 0
    transports: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # pulls refused, then recomputed


_KV_SOURCE_KEYS = {"address": str, "transfer_id": str, "num_tokens": int, "digest": str,
                   "layout": str}


def parse_transfer_params(kv_params: dict | None, ec_params: dict | None) -> TransferRequest:
    """InvalidRequestError for malformed parameters (the client's or router's fault)."""
    request = TransferRequest()
    if kv_params:
        if not isinstance(kv_params, dict):
            raise InvalidRequestError("kv_transfer_params must be an object")
        if kv_params.get("do_remote_decode"):
            request.export_kv = True
        elif "transfer_id" in kv_params:
            _check_fields(kv_params, _KV_SOURCE_KEYS, "kv_transfer_params")
            request.kv_source = kv_params
        else:
            raise InvalidRequestError("kv_transfer_params needs do_remote_decode (to a prefill "
                                      "worker) or the transfer_id a prefill worker returned")
    if ec_params:
        if not isinstance(ec_params, dict):
            raise InvalidRequestError("ec_transfer_params must be an object")
        _check_fields(ec_params, {"address": str, "items": dict}, "ec_transfer_params")
        if ec_params["items"]:
            request.ec_source = ec_params
    return request


def _check_fields(params: dict, types: dict, name: str) -> None:
    for key, kind in types.items():
        if not isinstance(params.get(key), kind) or isinstance(params.get(key), bool):
            raise InvalidRequestError(f"{name}.{key} is missing or not a {kind.__name__}")


def layout_signature(config: EngineConfig) -> str:
    """What two engines must agree on for one's KV blocks to fit the other's pool."""
    text, cache = config.model.text, config.cache
    groups = kv_cache_groups(config.model, cache)
    return (f"block_size={cache.block_size},kv={cache.kv_cache_dtype},layers="
            f"{text.num_hidden_layers},kv_heads={text.num_key_value_heads},head_dim={text.head_dim}"
            + (f",groups={[list(layers) for layers in groups.layers]}" if groups else ""))


def prompt_digest(token_ids: list[int], mm_hashes: list[str]) -> str:
    return hashlib.sha256(repr((list(token_ids), list(mm_hashes))).encode()).hexdigest()


def pull_into(request: Request, transfer: TransferRequest, config: EngineConfig) -> TransferStats:
    """Attach what the request's peers hold: embeddings of its media items
    (they skip the vision tower here) and its prompt's KV. Runs in a
    preprocessing worker; every wait is bounded by the transfer timeout."""
    stats = TransferStats()
    request.export_kv = transfer.export_kv
    pulls = [(_pull_embeddings, transfer.ec_source), (_pull_kv, transfer.kv_source)]
    for pull, source in pulls:
        if source is None:
            continue
        try:
            pull(request, source, config, stats)
        except TransferError as error:
            if config.transfer.load_failure_policy == "fail":
                raise
            # recompute: this engine holds the whole request, so it encodes or
            # prefills what it could not pull; the answer is the same, only later
            stats.failures.append(str(error))
            logger.warning("request %s: %s; computing it here instead", request.request_id, error)
    return stats


def _fetch(source: dict, keys: list[str], config: TransferConfig, stats: TransferStats):
    from foveal.disagg.transfer import fetch

    result = fetch(source["address"], keys, timeout_s=config.timeout_s,
                   max_bytes=config.buffer_bytes, peer_host_id=source.get("host_id"))
    stats.num_bytes += result.num_bytes
    stats.seconds += result.seconds
    stats.num_pulls += 1
    stats.transports.append(result.transport)
    return result.items


def _pull_embeddings(request: Request, source: dict, config: EngineConfig,
                     stats: TransferStats) -> None:
    wanted = [f.mm_hash for f in request.mm_features if f.mm_hash in source["items"]]
    if not wanted:
        return  # processed differently here (other processor options): encode locally
    items = _fetch(source, sorted(set(wanted)), config.transfer, stats)
    # Qwen3-VL's DeepStack rows travel beside each visual token: hidden per layer
    deepstack = len(getattr(config.model.vision, "deepstack_visual_indexes", ()))
    width = config.model.text.hidden_size * (1 + deepstack)
    for index, feature in enumerate(request.mm_features):
        if feature.mm_hash not in items:
            continue
        embeddings = items[feature.mm_hash][1][ENCODED_KEY]
        if tuple(embeddings.shape) != (feature.placeholder.length, width):
            raise TransferError(
                f"embeddings of {feature.modality} item {feature.mm_hash} have shape "
                f"{tuple(embeddings.shape)}; this engine needs ({feature.placeholder.length}, "
                f"{width}): the encode worker serves a different model")
        request.mm_features[index] = feature.without_payload().with_payload(
            {ENCODED_KEY: embeddings})


def _pull_kv(request: Request, source: dict, config: EngineConfig, stats: TransferStats) -> None:
    digest = prompt_digest(request.prompt_token_ids, [f.mm_hash for f in request.mm_features])
    if source["digest"] != digest:
        raise TransferError("the prefill worker computed a different prompt (token ids or media "
                            "differ): check that both serve the same model with the same options")
    if source["layout"] != layout_signature(config):
        raise TransferError(f"the prefill worker's KV layout {source['layout']!r} does not fit "
                            f"this engine's {layout_signature(config)!r}")
    if not 0 < source["num_tokens"] <= request.num_prompt_tokens:
        raise TransferError(f"kv_transfer_params.num_tokens={source['num_tokens']} does not fit "
                            f"a prompt of {request.num_prompt_tokens} tokens")
    meta, blocks = _fetch(source, [source["transfer_id"]], config.transfer, stats)[
        source["transfer_id"]]
    if meta.get("digest") != digest or meta.get("num_tokens") != source["num_tokens"]:
        raise TransferError("the KV blocks pulled do not belong to this prompt")
    num_blocks = -(-source["num_tokens"] // config.cache.block_size)
    if "kv" not in blocks or blocks["kv"].ndim != 6 or blocks["kv"].shape[2] != num_blocks:
        raise TransferError(f"the KV blocks pulled have shape "
                            f"{tuple(blocks['kv'].shape) if 'kv' in blocks else None}; "
                            f"{num_blocks} blocks were announced")
    request.kv_import = KVImport(source["num_tokens"], blocks)


class Exports:
    """What this engine serves to its peers: KV of finished prefills (one
    reader each, expiring after ttl_s) and embeddings (an LRU cache by
    mm_hash). The transfer server starts on the first export."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config.transfer
        self.layout = layout_signature(config)
        self._lock = threading.Lock()
        self._store = None
        self._server = None

    def _started(self):
        with self._lock:
            if self._server is None:
                from foveal.disagg.transfer import ExportStore, TransferServer

                self._store = ExportStore(self.config.buffer_bytes, self.config.ttl_s)
                self._server = TransferServer(self._store, self.config.host, self.config.port,
                                              self.config.advertise_host)
            return self._store, self._server

    def put_kv(self, request_id: str, blocks: dict, num_tokens: int, digest: str) -> dict:
        """-> the kv_transfer_params a decode worker pulls these blocks with."""
        store, server = self._started()
        transfer_id = f"kv-{request_id}-{uuid.uuid4().hex[:12]}"
        meta = {"num_tokens": num_tokens, "digest": digest, "layout": self.layout,
                "created": time.time()}
        store.put(transfer_id, meta, blocks, consume=True)
        return {"address": server.address, "host_id": server.host_id,
                "transfer_id": transfer_id, "num_tokens": num_tokens, "digest": digest,
                "layout": self.layout}

    def put_embeddings(self, embeddings: dict) -> None:
        store, _ = self._started()
        for mm_hash, tensor in embeddings.items():
            store.put(mm_hash, {"rows": int(tensor.shape[0])}, {ENCODED_KEY: tensor})

    def held_embeddings(self, mm_hashes: list[str]) -> set[str]:
        store = self._store
        return set() if store is None else {h for h in mm_hashes if h in store}

    def embedding_params(self, rows: dict[str, int]) -> dict:
        """-> the ec_transfer_params a prefill worker pulls these items with."""
        _, server = self._started()
        return {"address": server.address, "host_id": server.host_id, "items": dict(rows)}

    def stats(self) -> dict:
        return {} if self._store is None else self._store.stats()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
