"""What a processed media item is, as the engine and the workers see it.

Torch-free on purpose: the scheduler reads `mm_hash` and `placeholder` only;
`data` (pixel tensors, grid) is opaque to it. Plans carry features without
their array payload (`without_payload`): workers learn an item's grid and
timing with the request, and get its pixels once, by mm_hash, in the step
that encodes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


# data key of an item's embeddings, (placeholder.length, text hidden size)
ENCODED_KEY = "embeddings"
# data key of the token runs ((offset in the placeholder, length), ...) whose tokens
# attend to each other both ways (Gemma 3's images); plain data, so plans carry it
BIDIRECTIONAL_KEY = "bidirectional_runs"


@dataclass(frozen=True)
class PlaceholderRange:
    """Token positions [offset, offset + length) that the item's embeddings fill."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class MMFeature:
    """One processed media item of a request.

    modality:     "image" | "video"
    mm_hash:      content hash of the decoded media plus every processing
                  parameter that changes the tensors (keys every cache)
    placeholder:  where its embeddings go in the prompt's token ids; the
                  encoder output has exactly `placeholder.length` rows
    data:         model inputs, e.g. {"pixel_values": (N, C*T*P*P) tensor,
                  "grid_thw": (t, h, w)}. Array values (anything with a
                  `shape`) are the payload the vision encoder reads; plain
                  values (ints, floats, tuples) are what position rules read.
    """

    modality: str
    mm_hash: str
    placeholder: PlaceholderRange
    data: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_encoder_tokens(self) -> int:
        return self.placeholder.length

    @property
    def bidirectional_spans(self) -> tuple[tuple[int, int], ...]:
        """Prompt ranges [start, end) of its bidirectional runs: the scheduler never
        splits one over two steps, and attention lets their tokens see each other."""
        base = self.placeholder.offset
        return tuple((base + offset, base + offset + length)
                     for offset, length in self.data.get(BIDIRECTIONAL_KEY, ()))

    @property
    def is_encoded(self) -> bool:
        """Whether the payload is the item's embeddings (from an encode worker)
        rather than pixels: the workers cache them instead of running the tower."""
        return ENCODED_KEY in self.data

    @property
    def payload(self) -> dict[str, Any]:
        """The array entries of data (pixels): what only the encoder needs."""
        return {key: value for key, value in self.data.items() if _is_array(value)}

    def without_payload(self) -> "MMFeature":
        """This feature with plain data only, as plans carry it to workers."""
        plain = {key: value for key, value in self.data.items() if not _is_array(value)}
        return MMFeature(self.modality, self.mm_hash, self.placeholder, plain)

    def with_payload(self, payload: dict[str, Any]) -> "MMFeature":
        return MMFeature(self.modality, self.mm_hash, self.placeholder, {**self.data, **payload})


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and not isinstance(value, (int, float))
