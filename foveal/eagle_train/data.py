"""Training data for an EAGLE head: the target's own greedy answers to image
and video prompts, with the features the head reads, recorded from Foveal's
own forward passes (the numerics the head sees when serving).

The prompts are the demo tasks' train split (foveal/demo_model/tasks.py):
images, multi-image comparisons and clips with questions, through the
target's chat template; or the user's own, from a JSONL file (train on the
traffic the head will serve). The engine runs one request at a time with neither
chunking nor prefix caching, so each forward belongs to one request: its
prompt, then one generated token per decode step. The text decoder's own
`aux_layers` output gives the three auxiliary layers' inputs, recorded with the
positions of every row.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger("foveal")


@dataclass
class Sequence:
    token_ids: torch.Tensor  # (T,) prompt (placeholders expanded) + generated answer
    features: torch.Tensor  # (T - 1, 3 * hidden) aux-layer inputs at positions 0..T-2
    positions: torch.Tensor  # (A, T) the target's position ids (A = 3 for M-RoPE)
    answer_start: int  # index of the first generated token


class FeatureRecorder:
    """Wraps a Foveal text decoder's forward: every forward also returns the aux layers'
    inputs (the decoders' own `aux_layers` output, as when serving with a head), which
    are recorded with the positions; the caller still gets the hidden states alone."""

    def __init__(self, decoder: torch.nn.Module, aux_layers: tuple[int, ...]) -> None:
        self.aux_layers = tuple(aux_layers)
        self.forwards: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._decoder = decoder
        wrapped = decoder.forward

        def forward(inputs_embeds, positions, aux_layers=()):
            if aux_layers:  # a caller that wants its own aux layers (not during recording)
                return wrapped(inputs_embeds, positions, aux_layers)
            hidden, aux = wrapped(inputs_embeds, positions, self.aux_layers)
            self.forwards.append((positions.detach().clone(), aux.detach().float().clone()))
            return hidden

        decoder.forward = forward

    def close(self) -> None:
        del self._decoder.forward  # back to the class's forward


def task_conversations(num_prompts: int, start: int = 0, video: bool = True) -> list[list[dict]]:
    """The demo tasks' train-split prompts as chat conversations; video=False skips the
    clips (for a target that takes no video)."""
    from foveal.demo_model.tasks import make_sample

    conversations, index = [], start
    while len(conversations) < num_prompts:
        sample = make_sample("train", index)
        if video or sample.video is None:
            conversations.append(sample.messages())
        index += 1
    return conversations


def load_conversations(path: str) -> list[list[dict]]:
    """A JSONL file of prompts, one per line: {"messages": [OpenAI chat messages]}
    (image_url / video_url parts included) or {"prompt": "text"}."""
    conversations = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error})") from None
            if isinstance(item, dict) and isinstance(item.get("messages"), list):
                conversations.append(item["messages"])
            elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
                conversations.append([{"role": "user", "content": item["prompt"]}])
            else:
                raise ValueError(f"{path}:{number}: expected {{\"messages\": [...]}} or "
                                 "{\"prompt\": \"...\"}")
    if not conversations:
        raise ValueError(f"{path} holds no prompts")
    return conversations


def generate_sequences(target: str, aux_layers: tuple[int, ...],
                       conversations: list[list[dict]], max_tokens: int,
                       ignore_eos: bool) -> list[Sequence]:
    """Greedy answers of the target to each conversation, with features."""
    from tqdm import tqdm

    from foveal import LLM, SamplingParams

    from foveal.loader.hf_config import model_config_from_hf

    max_len = min(8192, model_config_from_hf(target).text.max_position_embeddings)
    llm = LLM(model=target, max_num_seqs=1, enable_prefix_caching=False,
              max_num_batched_tokens=max_len, max_model_len=max_len)
    model = llm.llm_engine.executor.driver_worker.model
    decoder = getattr(model, "language_model", None) or model.text_model  # Idefics3: text_model
    recorder = FeatureRecorder(decoder, aux_layers)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    sequences = []
    try:
        for messages in tqdm(conversations, desc="self-generated answers", dynamic_ncols=True):
            recorder.forwards.clear()
            output = llm.chat(messages, params, use_tqdm=False)[0]
            sequences.append(_sequence(output, recorder.forwards))
    finally:
        recorder.close()
        llm.shutdown()
    return sequences


def _sequence(output, forwards: list[tuple[torch.Tensor, torch.Tensor]]) -> Sequence:
    prompt = list(output.prompt_token_ids)
    answer = list(output.outputs[0].token_ids)
    token_ids = torch.tensor(prompt + answer, dtype=torch.long)
    positions = torch.cat([p.reshape(-1, p.shape[-1]) for p, _ in forwards], dim=-1)
    features = torch.cat([aux for _, aux in forwards])
    expected = len(token_ids) - 1  # the last token is sampled, never fed
    if features.shape[0] != expected:
        raise RuntimeError(f"recorded {features.shape[0]} feature rows for a sequence of "
                           f"{len(token_ids)} tokens; expected {expected}")
    positions = torch.cat([positions, positions[:, -1:] + 1], dim=-1)  # the last token's
    return Sequence(token_ids, features.to(torch.float16), positions, len(prompt))
