import torch

from foveal.sampling_params import SamplingParams
from foveal.worker.sampler import Sampler, request_generator

VOCAB = 50


def _logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _sample(logits, params, generators=None, seed=0):
    generators = generators or [request_generator(p, torch.device("cpu")) for p in params]
    return Sampler(seed)(logits, params, generators)


def test_greedy_is_argmax():
    logits = _logits(4)
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4


def test_greedy_rows_in_mixed_batch_are_argmax():
    logits = _logits(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)] * 2
    out = _sample(logits, params)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[2] == int(logits[2].argmax())


def test_top_k_one_equals_greedy():
    logits = _logits(8)
    for seed in range(5):
        out = _sample(logits, [SamplingParams(temperature=2.0, top_k=1)] * 8, seed=seed)
        assert out.token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy():
    logits = _logits(8)
    for seed in range(5):
        out = _sample(logits, [SamplingParams(temperature=2.0, top_p=1e-6)] * 8, seed=seed)
        assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_sampling_is_batch_invariant():
    target = _logits(1, seed=7)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)

    def run(companions: int, position: int) -> list[int]:
        generator = request_generator(params, torch.device("cpu"))
        sampler = Sampler(seed=companions)
        tokens = []
        for step in range(10):
            logits = _logits(companions + 1, seed=100 + step + companions)
            logits[position] = target[0]
            batch_params = [SamplingParams(temperature=0.8, top_k=5)] * (companions + 1)
            batch_params[position] = params
            generators = [None] * (companions + 1)
            generators[position] = generator
            tokens.append(sampler(logits, batch_params, generators).token_ids[position])
        return tokens

    alone = run(0, 0)
    assert run(3, 2) == alone
    assert run(5, 0) == alone
    assert len(set(alone)) > 1  # really sampled, not a constant


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(1, VOCAB)  # uniform: every seed is as likely to win
    draws = {_sample(logits, [SamplingParams(seed=seed)]).token_ids[0] for seed in range(20)}
    assert len(draws) > 1


def test_same_seed_gives_same_tokens():
    logits = torch.zeros(1, VOCAB)
    first = [_sample(logits, [SamplingParams(seed=5)]).token_ids[0] for _ in range(3)]
    assert first == [first[0]] * 3


def test_top_k_never_picks_a_token_outside_the_top_k():
    logits = _logits(16)
    allowed = logits.topk(3, dim=-1).indices
    sampler = Sampler(0)
    seen = set()
    for _ in range(50):
        out = sampler(logits, [SamplingParams(temperature=5.0, top_k=3)] * 16, [None] * 16)
        for row, token in enumerate(out.token_ids):
            assert token in allowed[row].tolist()
            seen.add((row, token))
    assert len(seen) > 16  # more than one token per row was drawn


def test_min_p_never_picks_a_filtered_token():
    logits = _logits(16)
    probs = logits.softmax(-1)
    keep = probs >= 0.2 * probs.max(-1, keepdim=True).values  # (16, V)
    sampler = Sampler(0)
    for _ in range(50):
        out = sampler(logits, [SamplingParams(temperature=1.0, min_p=0.2)] * 16, [None] * 16)
        for row, token in enumerate(out.token_ids):
            assert keep[row, token]


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(0)
    drawn = {sampler(logits, [SamplingParams(top_p=0.7)], [None]).token_ids[0]
             for _ in range(200)}
    assert drawn == {0, 1}


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(2000, 1)
    out = Sampler(0)(logits, [SamplingParams()] * 2000, [None] * 2000)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=3).float() / 2000
    assert torch.allclose(counts, torch.tensor([0.7, 0.2, 0.1]), atol=0.05)


def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = _logits(3)
    params = [SamplingParams(temperature=0.7, top_k=10, logprobs=4),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=0)]
    out = _sample(logits, params)
    expected = logits.log_softmax(-1)
    first = out.logprobs[0]
    token = out.token_ids[0]
    assert first.token_ids[0] == token
    assert abs(first.logprobs[0] - float(expected[0, token])) < 1e-5
    order = expected[0].argsort(descending=True).tolist()
    assert first.sampled_rank == order.index(token) + 1
    assert first.token_ids[1:] == order[:4]
    assert torch.allclose(torch.tensor(first.logprobs[1:]), expected[0, order[:4]])
    assert out.logprobs[1] is None
    assert out.logprobs[2].token_ids == [out.token_ids[2]]
    assert out.logprobs[2].sampled_rank == 1
