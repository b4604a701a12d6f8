"""Per-request sampling options, in vLLM's spelling."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from foveal.errors import SamplingParamsError

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token
    skip_special_tokens: bool = True
    # False: never draft tokens for this request, even when the engine speculates
    speculative_decoding: bool = True
    # Filled by the engine from generation_config.json / the tokenizer.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n == 1, f"n={self.n} is not supported yet; use n=1"),
            (0 <= self.temperature < math.inf,
             f"temperature must be >= 0 and finite, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (or -1 for off), got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs must be in [0, 20], got {self.logprobs}"),
            # torch.Generator.manual_seed takes [-2**63, 2**64)
            (self.seed is None or -2 ** 63 <= self.seed < 2 ** 64,
             f"seed must be a 64-bit integer, got {self.seed}"),
        ]
        for ok, message in checks:
            if not ok:
                raise SamplingParamsError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
