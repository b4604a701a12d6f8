"""Speculative decoding, worker side: the n-gram proposer, greedy verification,
and rejection sampling that keeps the target distribution."""
from __future__ import annotations

import pytest
import torch

from foveal.config import SpeculativeConfig
from foveal.errors import ConfigError
from foveal.sampling_params import SamplingParams
from foveal.worker.spec_decode import build_proposer, get_proposer_class, uses_draft_model
from foveal.worker.spec_decode.verify import verify_greedy, verify_sampled


def ngram(k_min=1, k_max=4):
    return build_proposer(SpeculativeConfig("ngram", 3, prompt_lookup_min=k_min,
                                            prompt_lookup_max=k_max))


def test_ngram_proposes_what_followed_the_longest_earlier_match():
    # suffix (2, 3) matched at index 1 -> propose what followed it
    assert ngram().propose([1, 2, 3, 4, 5, 6, 2, 3], 3) == [4, 5, 6]
    # a longer match wins over a more recent shorter one
    tokens = [7, 8, 9, 1, 5, 9, 1, 0, 7, 8, 9, 1]
    assert ngram().propose(tokens, 2) == [5, 9]


def test_ngram_prefers_a_recent_match_that_is_followed_by_enough_tokens():
    assert ngram().propose([5] * 8, 3) == [5, 5, 5]
    assert ngram().propose([5] * 6, 3) == [5, 5]  # no match followed by 3: the earliest


def test_ngram_without_a_match_or_below_min_proposes_nothing():
    assert ngram().propose([1, 2, 3, 4], 3) == []
    assert ngram(k_min=2).propose([1, 2, 9, 2], 3) == []
    assert ngram().propose([1], 3) == [] and ngram().propose([1, 1], 0) == []


def test_unknown_methods_are_config_errors_and_eagle_methods_use_a_draft_model():
    with pytest.raises(ConfigError, match="unknown"):
        get_proposer_class("medusa-x")
    for method in ("eagle", "eagle3"):
        assert get_proposer_class(method).reads_hidden_states and uses_draft_model(method)
    assert not uses_draft_model("ngram")


def test_greedy_verification_keeps_the_agreeing_prefix_plus_the_target_token():
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate([3, 4, 8, 6]):
        logits[row, token] = 5.0
    assert verify_greedy(logits, [3, 4, 5]) == [3, 4, 8]
    assert verify_greedy(logits, [3, 4, 8]) == [3, 4, 8, 6]  # all kept + the bonus token
    assert verify_greedy(logits, [1, 4, 8]) == [3]


P0 = torch.tensor([0.05, 0.4, 0.15, 0.3, 0.1])
P1 = torch.tensor([0.3, 0.1, 0.2, 0.2, 0.2])
P2 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def tolerance(counts: torch.Tensor) -> float:
    """3 / sqrt(n): about four times the total variation n exact draws show on 5 tokens."""
    return 3 / float(counts.sum()) ** 0.5


@pytest.mark.parametrize("drafts", [[1, 0], [0, 4]])
def test_rejection_sampling_keeps_the_target_distribution(drafts):
    """First token ~ P0 whatever the drafts; after an accepted first draft, the
    next token ~ P1 (the target's distribution given that draft). 20,000 runs
    with a fixed seed; total variation within `tolerance` of each count."""
    logits = torch.stack([P0, P1, P2]).log()
    params = SamplingParams(temperature=1.0)
    generator = torch.Generator().manual_seed(1234)
    first, second = torch.zeros(5), torch.zeros(5)
    for _ in range(20_000):
        run = verify_sampled(logits, drafts, params, generator)
        assert 1 <= len(run) <= 3 and run[:len(run) - 1] == drafts[:len(run) - 1]
        first[run[0]] += 1
        if run[0] == drafts[0]:
            second[run[1]] += 1
    assert total_variation(first, P0) < tolerance(first)
    assert total_variation(second, P1) < tolerance(second)
    acceptance = first[drafts[0]] / first.sum()
    assert float(acceptance) == pytest.approx(float(P0[drafts[0]]), abs=0.01)


def test_rejection_sampling_with_a_draft_distribution():
    logits = torch.stack([P0, P1]).log()
    q = torch.tensor([[0.6, 0.1, 0.1, 0.1, 0.1]])  # the draft samples its guess from q
    generator = torch.Generator().manual_seed(5)
    first = torch.zeros(5)
    for _ in range(20_000):
        draft = int(torch.multinomial(q[0], 1, generator=generator))
        run = verify_sampled(logits, [draft], SamplingParams(temperature=1.0), generator, q)
        first[run[0]] += 1
    assert total_variation(first, P0) < tolerance(first)
