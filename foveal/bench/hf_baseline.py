"""The transformers baseline: the same checkpoint folder and workload, run the
way a transformers user serves it offline — static batches through
`model.generate()`, left padding, greedy decoding.

With `hf_families` (each family's transformers side), the only code in foveal/
that imports transformers, and only when a baseline runs. Per-request times come from a logits processor that stamps every decode
step: its first call ends the prefill (first token), call k emits token k.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

import torch

from foveal.bench.hf_families import HF_FAMILIES, HFFamily
from foveal.bench.report import RequestRecord, ThroughputResult
from foveal.bench.workload import BenchRequest, PromptVocab
from foveal.errors import CheckpointError, FovealError

# Enough images per prompt for any workload; the bench's own engine limits apply to Foveal.
_EXPANSION_IMAGE_LIMIT = 1024

class _StepClock:
    """A logits processor that records when each generated token is chosen."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.is_cuda:
            torch.cuda.synchronize(scores.device)
        self.stamps.append(time.perf_counter())
        return scores


class HFBaseline:
    """Loads the checkpoint with transformers once; `run()` times a workload."""

    def __init__(self, model_dir: str | Path, device: str = "cpu",
                 dtype: torch.dtype = torch.float32,
                 mm_processor_kwargs: dict | None = None, max_model_len: int | None = None) -> None:
        import transformers

        self.model_dir = Path(model_dir)
        self.family = _family(self.model_dir)
        model_class = getattr(transformers, self.family.model_class)
        self.model = model_class.from_pretrained(self.model_dir, dtype=dtype).to(device).eval()
        self.device = device
        self.image_processor = self.family.load_image_processor(self.model_dir, mm_processor_kwargs)
        self.vocab = PromptVocab.from_model_dir(self.model_dir)
        self._input_processor = _foveal_input_processor(self.model_dir, mm_processor_kwargs,
                                                        max_model_len)
        self._expanded: dict[int, tuple[BenchRequest, list[int]]] = {}
        # Padding sits under attention_mask = 0; any embeddable id will do.
        self.pad_token_id = self.vocab.text_token_ids[0]

    def prepare(self, requests: Sequence[BenchRequest]) -> None:
        """Expand every request's placeholders now, outside the timed region."""
        for request in requests:
            self._expand(request)

    def warmup(self, request: BenchRequest) -> None:
        self.prepare([request])
        self._generate([request], time.perf_counter())

    def run(self, requests: Sequence[BenchRequest], batch_size: int) -> ThroughputResult:
        """All requests arrive at the start; they run in arrival order, batch_size at a time."""
        self.prepare(requests)
        start = time.perf_counter()
        records: list[RequestRecord] = []
        generated_tokens = 0
        for first in range(0, len(requests), batch_size):
            batch = requests[first:first + batch_size]
            batch_records, _, batch_generated = self._generate(batch, start)
            records.extend(batch_records)
            generated_tokens += batch_generated
        wall = time.perf_counter() - start
        return ThroughputResult("hf", wall, records, batch_size=batch_size,
                                extra={"generated_tokens": generated_tokens})

    def generate_tokens(self, requests: Sequence[BenchRequest]) -> list[list[int]]:
        """Each request's useful output tokens, all requests in one batch."""
        return self._generate(requests, time.perf_counter())[1]

    def _generate(self, batch: Sequence[BenchRequest],
                  start: float) -> tuple[list[RequestRecord], list[list[int]], int]:
        """Returns per-request records, useful tokens, and all tokens generated (padding waste included)."""
        from transformers import LogitsProcessorList

        inputs, prompt_lens = self._batch_inputs(batch)
        max_new_tokens = max(request.output_len for request in batch)
        clock = _StepClock()
        with torch.inference_mode():
            sequences = self.model.generate(
                **inputs, max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=self.pad_token_id,
                logits_processor=LogitsProcessorList([clock]))
        new_tokens = sequences[:, inputs["input_ids"].shape[1]:]  # (B, max_new_tokens)
        if new_tokens.shape[1] != max_new_tokens or len(clock.stamps) != max_new_tokens:
            raise FovealError(
                f"transformers generated {new_tokens.shape[1]} tokens ({len(clock.stamps)} steps) "
                f"where {max_new_tokens} were asked for; the baseline must not stop at EOS")
        records, tokens = [], []
        for row, (request, prompt_len) in enumerate(zip(batch, prompt_lens)):
            n = request.output_len
            records.append(RequestRecord(prompt_len, n, ttft_s=clock.stamps[0] - start,
                                         finished_s=clock.stamps[n - 1] - start))
            tokens.append(new_tokens[row, :n].tolist())
        return records, tokens, new_tokens.numel()

    def _batch_inputs(self, batch: Sequence[BenchRequest]) -> tuple[dict, list[int]]:
        """Left-padded generate() kwargs for a batch, and each prompt's unpadded length."""
        rows = [self._expand(request) for request in batch]
        width = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, ids in enumerate(rows):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask,
                  **self.family.image_inputs([request.images for request in batch], self.image_processor,
                                             input_ids, attention_mask, self.vocab.image_token_id)}
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        return {k: v.to(self.device) for k, v in inputs.items()}, [len(ids) for ids in rows]

    def _expand(self, request: BenchRequest) -> list[int]:
        """The prompt with each image's placeholder expanded, as Foveal expands it."""
        known = self._expanded.get(id(request))
        if known is None or known[0] is not request:
            from foveal.sampling_params import SamplingParams

            processed = self._input_processor.process(
                f"hf-{len(self._expanded)}", request.to_prompt(), SamplingParams(max_tokens=1))
            known = self._expanded[id(request)] = (request, processed.request.prompt_token_ids)
        return known[1]


def _foveal_input_processor(model_dir: Path, mm_processor_kwargs: dict | None,
                            max_model_len: int | None):
    from foveal.engine_args import EngineArgs
    from foveal.input_processor.processor import InputProcessor
    from foveal.tokenizer import Tokenizer

    kwargs = {"limit_mm_per_prompt": {"image": _EXPANSION_IMAGE_LIMIT},
              "mm_processor_kwargs": dict(mm_processor_kwargs or {})}
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    config = EngineArgs.from_kwargs(str(model_dir), **kwargs).create_engine_config()
    return InputProcessor(config, Tokenizer.from_pretrained(str(model_dir)))


def _family(model_dir: Path) -> HFFamily:
    try:
        model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    except FileNotFoundError:
        raise CheckpointError(f"{model_dir} has no config.json") from None
    if model_type not in HF_FAMILIES:
        raise CheckpointError(f"the transformers baseline supports model_type "
                              f"{sorted(HF_FAMILIES)}, not {model_type!r}")
    return HF_FAMILIES[model_type]
