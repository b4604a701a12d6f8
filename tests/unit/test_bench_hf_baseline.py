"""The transformers baseline on a tiny Qwen2-VL checkpoint built with transformers itself."""
from __future__ import annotations

import json

import pytest
import torch

from foveal.bench.workload import PromptVocab, WorkloadSpec, build_workload
from foveal.errors import CheckpointError
from tests.models.hf_checkpoint import IMAGE_PAD_ID, write_hf_tiny_qwen2_vl


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    return write_hf_tiny_qwen2_vl(tmp_path_factory.mktemp("hf-tiny-qwen2-vl"))


@pytest.fixture(scope="module")
def baseline(hf_checkpoint):
    from foveal.bench.hf_baseline import HFBaseline

    return HFBaseline(hf_checkpoint)


@pytest.fixture(scope="module")
def requests(hf_checkpoint):
    spec = WorkloadSpec(num_prompts=5, images_per_prompt=2, image_size=(64, 48), input_len=6,
                        output_len=6, output_len_range=0.5, seed=0)
    return build_workload(spec, PromptVocab.from_model_dir(hf_checkpoint))


def test_generates_requested_lengths_despite_eos(baseline, requests):
    tokens = baseline.generate_tokens(requests)
    assert [len(t) for t in tokens] == [r.output_len for r in requests]
    assert len({r.output_len for r in requests}) > 1


def test_batched_left_padded_equals_one_at_a_time(baseline, requests):
    batched = baseline.generate_tokens(requests)
    alone = [baseline.generate_tokens([request])[0] for request in requests]
    assert batched == alone


def test_image_tokens_marked_and_expanded(baseline, requests):
    inputs, prompt_lens = baseline._batch_inputs(requests[:3])
    input_ids, mask, types = inputs["input_ids"], inputs["attention_mask"], inputs["mm_token_type_ids"]
    assert torch.equal(types.bool(), (input_ids == IMAGE_PAD_ID) & mask.bool())
    assert types[mask == 0].sum() == 0
    visual_tokens = int((inputs["image_grid_thw"].prod(-1) // 4).sum())
    assert int(types.sum()) == visual_tokens
    assert prompt_lens == mask.sum(-1).tolist()
    assert all(row[-len_:].all() for row, len_ in zip(mask, prompt_lens))  # left padding


def test_run_records_every_request_per_batch_size(baseline, requests):
    result = baseline.run(requests, batch_size=2)
    summary = result.summary()
    assert summary["batch_size"] == 2 and summary["num_requests"] == 5
    assert summary["output_tokens"] == sum(r.output_len for r in requests)
    # a batch runs to its longest request: 3 batches of 2, 2, 1 rows
    longest = [max(r.output_len for r in requests[i:i + 2]) for i in (0, 2, 4)]
    assert summary["generated_tokens"] == 2 * longest[0] + 2 * longest[1] + longest[2]
    ttfts = [record.ttft_s for record in result.records]
    assert ttfts[0] == ttfts[1] < ttfts[2] == ttfts[3] < ttfts[4]
    assert all(r.finished_s >= r.ttft_s > 0 for r in result.records)


def test_unknown_model_type_is_a_checkpoint_error(tmp_path):
    from foveal.bench.hf_baseline import HFBaseline

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="llama"):
        HFBaseline(tmp_path)
