"""Speculative decoding, worker side: proposers (a registry) and draft verification.

A proposer guesses the next tokens of a request from what the worker holds;
the guesses travel back to the scheduler in ModelRunnerOutput.spec_token_ids,
come back next step as tokens to verify (StepPlan.scheduled_spec_decode_tokens),
and `verify.py` keeps the longest run the target model agrees with.
"""
from __future__ import annotations

from typing import Protocol

from foveal.config import SpeculativeConfig
from foveal.errors import ConfigError
from foveal.lazy_import import resolve

# method -> "module:Class". A class with reads_hidden_states = True is a draft
# model the model runner drives after the target's forward (EAGLE heads); the
# others propose from a request's tokens (Proposer below).
_PROPOSERS: dict[str, str] = {
    "ngram": "foveal.worker.spec_decode.ngram:NgramProposer",
    "eagle": "foveal.worker.spec_decode.eagle:EagleProposer",
    "eagle3": "foveal.worker.spec_decode.eagle:EagleProposer",
}


class Proposer(Protocol):
    def __init__(self, config: SpeculativeConfig) -> None: ...

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to num_tokens guesses of the tokens after token_ids (may be fewer, or none)."""


def proposer_names() -> list[str]:
    return sorted(_PROPOSERS)


def uses_draft_model(method: str) -> bool:
    """Whether `method` drafts with a model that reads the target's hidden states."""
    return method in ("eagle", "eagle3")


def get_proposer_class(method: str) -> type:
    if method not in _PROPOSERS:
        raise ConfigError(f"speculative method {method!r} is unknown; use one of "
                          f"{proposer_names()}")
    return resolve(_PROPOSERS[method])


def build_proposer(config: SpeculativeConfig) -> Proposer:
    return get_proposer_class(config.method)(config)
