"""What a processed media item is, as the engine and the workers see it.

Torch-free on purpose: the scheduler reads `mm_hash` and `placeholder` only;
`data` (pixel tensors, grid) is opaque to it and consumed by the model runner.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
                  "grid_thw": (t, h, w)}
    """

    modality: str
    mm_hash: str
    placeholder: PlaceholderRange
    data: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_encoder_tokens(self) -> int:
        return self.placeholder.length
