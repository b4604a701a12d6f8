"""What one step samples: a token for each request that reached its last known
token, or, for a request with drafts, the run of drafts the target accepts
plus one token (spec_decode/verify.py); then the next drafts, when the engine
speculates (spec_decode proposers)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from foveal.config import SpeculativeConfig
from foveal.engine.plan import ModelRunnerOutput
from foveal.worker.sampler import Sampler, compute_logprobs
from foveal.worker.spec_decode import build_proposer
from foveal.worker.spec_decode.verify import verify_greedy, verify_sampled

if TYPE_CHECKING:
    from foveal.worker.model_runner import ScheduledRequest


class StepSampling:
    def __init__(self, model: torch.nn.Module, sampler: Sampler,
                 speculative: SpeculativeConfig | None, with_token_proposer: bool = True) -> None:
        """with_token_proposer: draft from the tokens here (n-gram); False when a
        draft model proposes after the step (EAGLE, in the model runner)."""
        self.model = model
        # the model's LM head, or a compiled one (compiled_decode.py)
        self.compute_logits = model.compute_logits
        self.sampler = sampler
        self.speculative = speculative
        self.proposer = (build_proposer(speculative)
                         if speculative is not None and with_token_proposer else None)

    def sample(self, hidden_states: torch.Tensor, sampled: list["ScheduledRequest"],
               output: ModelRunnerOutput) -> None:
        """hidden_states (N, hidden): 1 + len(drafts) rows per sampled request, in order."""
        logits = self.compute_logits(hidden_states)  # (N, vocab) float32
        counts = [1 + len(item.drafts) for item in sampled]
        per_request = logits.split(counts)
        plain = [i for i, item in enumerate(sampled) if not item.drafts]
        runs: dict[int, list[int]] = {}
        if plain:
            rows = torch.stack([per_request[i][0] for i in plain])  # (P, vocab)
            result = self.sampler(rows, [sampled[i].state.sampling_params for i in plain],
                                  [sampled[i].state.generator for i in plain])
            runs.update({i: [token] for i, token in zip(plain, result.token_ids)})
        for i, item in enumerate(sampled):
            if item.drafts:
                runs[i] = self._verify(per_request[i], item)
        for i, item in enumerate(sampled):
            self._record(item, runs[i], per_request[i][:len(runs[i])], output)

    def _verify(self, logits: torch.Tensor, item: "ScheduledRequest") -> list[int]:
        params = item.state.sampling_params
        if params.greedy:
            return verify_greedy(logits, item.drafts)
        generator = item.state.generator or self.sampler.generator
        return verify_sampled(logits, item.drafts, params, generator)

    def _record(self, item: "ScheduledRequest", run: list[int], logits: torch.Tensor,
                output: ModelRunnerOutput) -> None:
        state = item.state
        state.token_ids.extend(run)
        output.sampled_token_ids[state.request_id] = run
        params = state.sampling_params
        if params.logprobs is not None:
            output.logprobs[state.request_id] = compute_logprobs(
                logits, torch.tensor(run, device=logits.device), [params] * len(run))
        if self.proposer is not None and params.speculative_decoding:
            drafts = self.proposer.propose(state.token_ids,
                                           self.speculative.num_speculative_tokens)
            if drafts:
                output.spec_token_ids[state.request_id] = drafts
