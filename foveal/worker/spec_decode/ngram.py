"""Prompt-lookup (n-gram) proposer: the tokens that followed the last earlier
occurrence of the request's latest n-gram.

Strong where answers copy from the prompt: OCR text, PDF text layers and
transcripts put the words the model is about to write in the context.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from foveal.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Longest suffix n-gram (max_n down to min_n) found earlier in token_ids;
        the tokens after its most recent earlier match that is followed by
        num_tokens tokens (else after its earliest match, which is followed by
        the most)."""
        if num_tokens <= 0:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            windows = sliding_window_view(tokens[:-1], n)  # (L - n, n): every earlier n-gram
            matches = np.flatnonzero((windows == suffix).all(axis=1))
            if len(matches):
                followed = matches[matches + n + num_tokens <= len(tokens)]
                start = int(followed[-1] if len(followed) else matches[0]) + n
                return tokens[start:start + num_tokens].tolist()
        return []
