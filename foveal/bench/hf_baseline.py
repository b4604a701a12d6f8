"""The transformers baseline: the same checkpoint folder and workload, run the
way a transformers user serves it offline — static batches through
`model.generate()`, left padding, greedy decoding.

The only module in foveal/ that imports transformers, and only when a baseline
runs. Per-request times come from a logits processor that stamps every decode
step: its first call ends the prefill (first token), call k emits token k.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

import torch

from foveal.bench.report import RequestRecord, ThroughputResult
from foveal.bench.workload import BenchRequest, PromptVocab
from foveal.errors import CheckpointError, FovealError

# config.json model_type -> transformers class name
HF_MODEL_CLASSES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}


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
                 mm_processor_kwargs: dict | None = None) -> None:
        import transformers
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil)

        self.model_dir = Path(model_dir)
        model_class = getattr(transformers, _model_class_name(self.model_dir))
        self.model = model_class.from_pretrained(self.model_dir, dtype=dtype).to(device).eval()
        self.device = device
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(
            self.model_dir, **(mm_processor_kwargs or {}))
        self.vocab = PromptVocab.from_model_dir(self.model_dir)
        # Padding sits under attention_mask = 0; any embeddable id will do.
        self.pad_token_id = self.vocab.text_token_ids[0]

    def warmup(self, request: BenchRequest) -> None:
        self._generate([request], time.perf_counter())

    def run(self, requests: Sequence[BenchRequest], batch_size: int) -> ThroughputResult:
        """All requests arrive at the start; they run in arrival order, batch_size at a time."""
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
        rows, pixel_values, grids = [], [], []
        for request in batch:
            ids, request_pixels, request_grids = self._expand(request)
            rows.append(ids)
            pixel_values += request_pixels
            grids += request_grids
        width = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, ids in enumerate(rows):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        # 1 on image tokens, 0 on text and padding; without it transformers
        # silently falls back to 1-D positions instead of M-RoPE.
        mm_token_type_ids = ((input_ids == self.vocab.image_pad_id) & attention_mask.bool()).int()
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask,
                  "mm_token_type_ids": mm_token_type_ids}
        if grids:
            inputs["pixel_values"] = torch.cat(pixel_values).to(self.model.dtype)
            inputs["image_grid_thw"] = torch.cat(grids)
        return {k: v.to(self.device) for k, v in inputs.items()}, [len(ids) for ids in rows]

    def _expand(self, request: BenchRequest) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
        """Process the request's images; repeat each <|image_pad|> once per visual token."""
        pad_id = self.vocab.image_pad_id
        if request.prompt_token_ids.count(pad_id) != len(request.images):
            raise FovealError(f"prompt has {request.prompt_token_ids.count(pad_id)} "
                              f"<|image_pad|> tokens for {len(request.images)} images")
        if not request.images:
            return list(request.prompt_token_ids), [], []
        processed = self.image_processor(images=list(request.images), return_tensors="pt")
        grids = processed["image_grid_thw"]  # (num_images, 3): t, h, w in patches
        counts = iter((grids.prod(-1) // self.image_processor.merge_size ** 2).tolist())
        ids: list[int] = []
        for token in request.prompt_token_ids:
            ids.extend([pad_id] * next(counts) if token == pad_id else [token])
        return ids, [processed["pixel_values"]], [grids]


def _model_class_name(model_dir: Path) -> str:
    try:
        model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    except FileNotFoundError:
        raise CheckpointError(f"{model_dir} has no config.json") from None
    if model_type not in HF_MODEL_CLASSES:
        raise CheckpointError(f"the transformers baseline supports model_type "
                              f"{sorted(HF_MODEL_CLASSES)}, not {model_type!r}")
    return HF_MODEL_CLASSES[model_type]
