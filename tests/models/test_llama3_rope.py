"""Llama 3.1's llama3 RoPE scaling (and linear scaling): the inverse frequencies
equal transformers', and a LLaVA checkpoint whose Llama decoder uses llama3
scaling gives transformers' greedy tokens and logprobs through Foveal's LLM."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from foveal import LLM, SamplingParams
from foveal.config import RopeScaling
from foveal.layers.rotary import rope_inv_freq, scaled_inv_freq
from tests.models.hf_reference import hf_greedy
from tests.models.llava_tiny import IMAGE_TOKEN_ID, hf_model, image_processor, write_checkpoint

# A short original context so the scaling moves frequencies that matter at these lengths.
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    LLAMA3, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}])
def test_inverse_frequencies_equal_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=1024, num_attention_heads=8, rope_parameters=rope)
    expected, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    scaling = RopeScaling(rope["rope_type"], rope["factor"], rope.get("low_freq_factor", 1.0),
                          rope.get("high_freq_factor", 4.0), rope.get("original_max_position_embeddings", 0))
    ours = scaled_inv_freq(rope_inv_freq(128, rope["rope_theta"]), scaling)
    assert attention_factor == 1.0
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    assert not torch.equal(ours, rope_inv_freq(128, rope["rope_theta"]))


def test_llava_with_llama3_rope_matches_transformers(tmp_path):
    path = write_checkpoint("llava", tmp_path / "llava-llama3", rope=LLAMA3)
    hf = hf_model("llava", rope=LLAMA3)
    picture = Image.fromarray(np.random.default_rng(5).integers(0, 256, (70, 90, 3), dtype=np.uint8))
    conversation = [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": picture},
        {"type": "text", "text": "Describe the picture in a long sentence, then count the colours."}]}]
    llm = LLM(model=str(path), max_model_len=512, max_num_batched_tokens=13, block_size=8,
              kv_cache_memory_bytes=8 << 20)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    output = llm.chat([conversation], params, use_tqdm=False)[0]
    prompt = output.prompt_token_ids
    assert prompt.count(IMAGE_TOKEN_ID) == 16 and len(prompt) > 40  # past the 32-token original context
    pixels = {"pixel_values": image_processor("llava")(images=[picture], return_tensors="pt")["pixel_values"]}
    tokens, logprobs = hf_greedy(hf, prompt, pixels, 8)
    completion = output.outputs[0]
    assert list(completion.token_ids) == tokens
    ours = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
    np.testing.assert_allclose(ours, logprobs, atol=2e-4, rtol=0)
    # the scaling is in use: the same weights with plain RoPE give other logits
    plain = hf_model("llava")
    with torch.inference_mode():
        scaled_logits = hf(input_ids=torch.tensor([prompt]), **pixels).logits[0, -1]
        plain_logits = plain(input_ids=torch.tensor([prompt]), **pixels).logits[0, -1]
    assert (scaled_logits - plain_logits).abs().max() > 1e-2
