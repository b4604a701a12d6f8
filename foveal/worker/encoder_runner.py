"""Worker half of the encoder cache: mm_hash -> vision-encoder embeddings.

The scheduler half decides which items to encode each step and which hashes
to free; this half runs the vision tower on the scheduled items (one batched
call per step) and hands out the rows that a prefill chunk covers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from foveal.multimodal.inputs import ENCODED_KEY, MMFeature


@dataclass
class EncodeResult:
    num_items_run: int = 0
    # request id -> why one of its items could not be encoded
    failed_requests: dict[str, str] = field(default_factory=dict)


class EncoderCache:
    def __init__(self) -> None:
        self._embeddings: dict[str, torch.Tensor] = {}  # mm_hash -> (num_tokens, hidden)

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._embeddings

    def __len__(self) -> int:
        return len(self._embeddings)

    def put(self, mm_hash: str, embeddings: torch.Tensor) -> None:
        self._embeddings[mm_hash] = embeddings

    def get(self, mm_hash: str) -> torch.Tensor:
        return self._embeddings[mm_hash]  # (num_tokens, hidden)

    def drop(self, mm_hashes: list[str]) -> None:
        for mm_hash in mm_hashes:
            self._embeddings.pop(mm_hash, None)

    def rows(self, mm_hash: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of an item's embeddings, counted from the start of
        its placeholder range: (end - start, hidden)."""
        return self._embeddings[mm_hash][start:end]

    def encode(self, model, scheduled: list[tuple[str, MMFeature]]) -> EncodeResult:
        """Run the (request id, item) pairs not cached yet through
        model.embed_multimodal in one batched call and store each output.

        If the batch fails, each item is retried alone so that only the
        requests owning a bad item fail; the others proceed.
        """
        owners: dict[str, list[str]] = {}
        pending: dict[str, MMFeature] = {}
        imported = EncodeResult()
        for request_id, feature in scheduled:
            if feature.mm_hash in self._embeddings:
                continue
            if feature.is_encoded:  # an encode worker's output: no tower to run
                self._import(request_id, feature, imported)
                continue
            owners.setdefault(feature.mm_hash, []).append(request_id)
            pending.setdefault(feature.mm_hash, feature)
        if not pending:
            return imported
        features = list(pending.values())
        try:
            self._store(features, model.embed_multimodal(features))
            result = EncodeResult(num_items_run=len(features))
        except Exception:  # noqa: BLE001 - isolated per item below
            result = self._encode_one_by_one(model, features, owners)
        result.failed_requests.update(imported.failed_requests)
        return result

    def _import(self, request_id: str, feature: MMFeature, result: EncodeResult) -> None:
        embeddings = feature.data[ENCODED_KEY]
        if embeddings.ndim != 2 or embeddings.shape[0] != feature.placeholder.length:
            result.failed_requests[request_id] = (
                f"imported embeddings of {feature.modality} item {feature.mm_hash} have shape "
                f"{tuple(embeddings.shape)}; its placeholder has {feature.placeholder.length} "
                f"tokens")
            return
        self._embeddings[feature.mm_hash] = embeddings

    def _encode_one_by_one(self, model, features: list[MMFeature],
                           owners: dict[str, list[str]]) -> EncodeResult:
        result = EncodeResult()
        for feature in features:
            try:
                self._store([feature], model.embed_multimodal([feature]))
                result.num_items_run += 1
            # A bad item (corrupt pixels, unsupported grid) must fail only the
            # requests that sent it, whatever the vision tower raised.
            except Exception as exc:  # noqa: BLE001
                message = (f"encoding {feature.modality} item {feature.mm_hash} failed: "
                           f"{type(exc).__name__}: {exc}")
                for request_id in owners[feature.mm_hash]:
                    result.failed_requests[request_id] = message
        return result

    def _store(self, features: list[MMFeature], outputs: list[torch.Tensor]) -> None:
        if len(outputs) != len(features):
            raise ValueError(f"embed_multimodal returned {len(outputs)} tensors "
                             f"for {len(features)} items")
        for feature, embeddings in zip(features, outputs):
            if embeddings.shape[0] != feature.placeholder.length:
                raise ValueError(f"the encoder gave {embeddings.shape[0]} rows, the "
                                 f"placeholder has {feature.placeholder.length} tokens")
        for feature, embeddings in zip(features, outputs):
            self._embeddings[feature.mm_hash] = embeddings
