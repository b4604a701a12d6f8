"""The transformers baseline on other model families: the same workload through
transformers' generate() and through Foveal gives the same greedy tokens, and a
left-padded batch gives what each prompt gives alone."""
from __future__ import annotations

import pytest

from foveal import LLM, SamplingParams
from foveal.bench.workload import PromptVocab, WorkloadSpec, build_workload
from foveal.loader.tiny_model import ARCH_PRESETS, build_checkpoint

pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["llava_next", "llava_onevision", "gemma3", "smolvlm", "qwen3_vl",
                                  "qwen3_vl_moe"])
def test_baseline_matches_foveal_on_a_multi_image_workload(tmp_path, arch):
    from foveal.bench.hf_baseline import HFBaseline

    folder = build_checkpoint(tmp_path / arch, ARCH_PRESETS[arch])
    vocab = PromptVocab.from_model_dir(folder)
    spec = WorkloadSpec(num_prompts=3, images_per_prompt=2, image_size=(96, 64), input_len=8,
                        output_len=5, output_len_range=0.4, seed=1)
    requests = build_workload(spec, vocab)
    baseline = HFBaseline(folder)
    batched = baseline.generate_tokens(requests)
    alone = [baseline.generate_tokens([request])[0] for request in requests]
    assert batched == alone
    assert [len(tokens) for tokens in batched] == [r.output_len for r in requests]

    llm = LLM(model=str(folder), limit_mm_per_prompt={"image": 2})
    outputs = llm.generate([r.to_prompt() for r in requests],
                           [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
                            for r in requests], use_tqdm=False)
    assert [list(output.outputs[0].token_ids) for output in outputs] == alone
    # both sides saw the same expanded prompts: the baseline's lengths are Foveal's
    inputs, prompt_lens = baseline._batch_inputs(requests)
    assert prompt_lens == [len(output.prompt_token_ids) for output in outputs]
    assert prompt_lens[0] > len(requests[0].prompt_token_ids) + 2  # images expanded
    assert "pixel_values" in inputs
