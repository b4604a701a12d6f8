"""LLaVA with the engine's features: Foveal's own tiny checkpoints (presets,
export) load in transformers with the same greedy answer; both checkpoint name
layouts load; tensor parallelism (sharded and data-parallel tower), n-gram
speculation, chunked prefill and int8 KV give the tokens of one rank, with
images and a OneVision video; OneVision video + image parity; LLaVA-NeXT
refuses videos clearly; hub configs read at their real shapes."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from foveal import LLM, SamplingParams
from foveal.errors import ConfigError, InvalidRequestError
from foveal.loader.hf_config import model_config_from_dict, model_config_from_hf
from foveal.loader.presets import get_preset
from tests.models.llava_tiny import write_checkpoint
from tests.models.test_llava_parity import _image, _user

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
OPTIONS = dict(max_model_len=512, kv_cache_memory_bytes=1 << 21, max_num_batched_tokens=256)


def _chats() -> list:
    return [_user("Describe it.", _image(130, 40, 1)), _user("Say red green blue, red green blue."),
            _user("Compare.", _image(40, 150, 2), _image(60, 60, 3))]


def _video_prompt() -> dict:
    rng = np.random.default_rng(4)
    frames = [rng.integers(0, 256, (40, 70, 3), dtype=np.uint8) for _ in range(5)]
    return {"prompt": "USER: <|video_pad|>\nWhat moves? ASSISTANT:",
            "multi_modal_data": {"video": {"frames": frames, "fps": 1}}}


def _run(llm: LLM, video: bool = False) -> list[list[int]]:
    outputs = llm.chat(_chats(), GREEDY, use_tqdm=False)
    if video:
        outputs += llm.generate([_video_prompt()], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@torch.inference_mode()
def test_foveal_tiny_checkpoint_answers_like_transformers(tiny_checkpoints):
    import transformers
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    path = tiny_checkpoints("tiny-llava-next")
    llm = LLM(model=path, **OPTIONS)
    output = llm.chat([_chats()[0]], GREEDY, use_tqdm=False)[0]
    with pytest.raises(InvalidRequestError, match="images only"):
        llm.generate([_video_prompt()], GREEDY, use_tqdm=False)
    missing = {**_video_prompt(), "multi_modal_data": {"video": "/nonexistent/clip.mp4"}}
    with pytest.raises(InvalidRequestError, match="images only"):  # refused before it is opened
        llm.generate([missing], GREEDY, use_tqdm=False)
    hf = transformers.LlavaNextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    inputs = dict(LlavaNextImageProcessorPil.from_pretrained(path)(images=[_image(130, 40, 1)],
                                                                    return_tensors="pt"))
    ids = list(output.prompt_token_ids)
    for _ in range(len(output.outputs[0].token_ids)):
        ids.append(int(hf(input_ids=torch.tensor([ids]), **inputs).logits[0, -1].argmax()))
    assert ids[len(output.prompt_token_ids):] == list(output.outputs[0].token_ids)


def test_both_checkpoint_name_layouts_load_the_same_weights(tmp_path):
    from foveal.config import CacheConfig, EngineConfig, MultimodalConfig, SchedulerConfig
    from foveal.loader.weights import load_model

    old = write_checkpoint("llava_next", tmp_path / "old")
    tensors = load_file(str(old / "model.safetensors"))
    assert "language_model.model.embed_tokens.weight" in tensors and "image_newline" in tensors
    renames = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
               ("vision_tower.", "model.vision_tower.vision_model."),
               ("multi_modal_projector.", "model.multi_modal_projector."),
               ("image_newline", "model.image_newline"))
    new_tensors = {}
    for name, tensor in tensors.items():
        source, target = next((s, t) for s, t in renames if name.startswith(s))
        new_tensors[target + name[len(source):]] = tensor
    new = tmp_path / "new"
    new.mkdir()
    save_file(new_tensors, str(new / "model.safetensors"))
    (new / "config.json").write_text((old / "config.json").read_text())

    def params(path):
        config = EngineConfig(model_config_from_hf(str(path)), CacheConfig(), SchedulerConfig(),
                              MultimodalConfig())
        return dict(load_model(config).named_parameters())

    ours_old, ours_new = params(old), params(new)
    assert ours_old.keys() == ours_new.keys()
    assert all(torch.equal(ours_old[k], ours_new[k]) for k in ours_old)


def test_tensor_parallel_speculation_and_int8_kv_give_the_tokens_of_one_rank(tiny_checkpoints):
    path = tiny_checkpoints("tiny-llava-onevision")
    one_rank = LLM(model=path, **{**OPTIONS, "kv_cache_dtype": "int8"})
    expected = _run(one_rank, video=True)
    for options in ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
                     "max_num_batched_tokens": 16},  # sharded tower, chunks through the images
                    {"mm_encoder_tp_mode": "data"}):  # each rank encodes some of a step's images
        llm = LLM(model=path, tensor_parallel_size=2, **{**OPTIONS, "kv_cache_dtype": "int8", **options})
        try:
            assert _run(llm, video=True) == expected
        finally:
            llm.shutdown()


def test_hub_configs_read_at_their_real_shapes():
    # llava-hf/llava-1.5-7b-hf publishes only what differs from transformers' defaults.
    hub = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
           "image_token_index": 32000, "text_config": {"model_type": "llama", "vocab_size": 32064,
                                                       "rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
           "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                             "model_type": "clip_vision_model", "num_attention_heads": 16,
                             "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768}}
    config = model_config_from_dict(hub)
    assert (config.text.hidden_size, config.text.num_hidden_layers, config.text.num_key_value_heads,
            config.text.rope_theta, config.text.attention_bias) == (4096, 32, 32, 10000.0, False)
    assert (config.vision.hidden_act, config.family_config.feature_layers,
            config.family_config.select_strategy) == ("quick_gelu", (-2,), "default")
    mistral = {**hub["text_config"], "model_type": "mistral"}  # MistralConfig's sliding_window: 4096
    with pytest.raises(ConfigError, match="sliding_window=4096"):
        model_config_from_dict({**hub, "model_type": "llava_next", "text_config": mistral})
    with pytest.raises(ConfigError, match="rope_type 'yarn'"):
        model_config_from_dict({**hub, "text_config": {"rope_scaling": {"rope_type": "yarn", "factor": 8}}})
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    scaled = model_config_from_dict({**hub, "text_config": {"rope_scaling": llama31}}).text.rope_scaling
    assert (scaled.rope_type, scaled.factor, scaled.original_max_position_embeddings) == ("llama3", 8.0, 8192)


# 1000x700: NeXT picks the 672x672 canvas (2x2 tiles, 48x48 features, unpadded to 34 rows + 34
# newlines); the counts equal transformers' processors (tests/unit/test_llava_processor.py).
@pytest.mark.parametrize("name,tokens", [("llava-1.5-7b", 576), ("llava-next-7b", 576 + 34 * 48 + 34),
                                         ("llava-onevision-0.5b", 4941)])
def test_real_shape_presets_process_images_at_their_real_token_counts(name, tokens, tmp_path):
    from foveal.loader.tiny_tokenizer import write_tiny_tokenizer
    from foveal.multimodal.processors.llava_family import processor_from_checkpoint, write_checkpoint_files

    preset = get_preset(name)
    (tmp_path / "config.json").write_text(json.dumps(preset))
    write_tiny_tokenizer(tmp_path)
    write_checkpoint_files(tmp_path, preset)
    assert model_config_from_hf(str(tmp_path)).architecture == preset["architectures"][0]
    assert processor_from_checkpoint(str(tmp_path)).num_tokens_for_size(1000, 700) == tokens


@torch.inference_mode()
def test_onevision_video_and_image_prompt_matches_transformers(tmp_path):
    import transformers

    from foveal.multimodal.processors.llava_family import processor_from_checkpoint
    from tests.models.hf_reference import hf_greedy
    from tests.models.test_llava_parity import _hf_inputs

    path = write_checkpoint("llava_onevision", tmp_path / "ov")
    rng = np.random.default_rng(5)
    frames = [rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) for _ in range(4)]  # tower size: no resize
    picture = _image(90, 50, 6)
    prompt = "USER: <|video_pad|>\n<|image_pad|>\nWhat happens? ASSISTANT:"
    llm = LLM(model=str(path), max_model_len=1024, max_num_batched_tokens=13, block_size=8,
              kv_cache_memory_bytes=8 << 20)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    output = llm.generate([{"prompt": prompt, "multi_modal_data": {
        "video": {"frames": frames, "fps": 1}, "image": picture}}], params, use_tqdm=False)[0]
    assert output.prompt_token_ids.count(13) == 4 * 2 * 2 + 1  # 4 frames pooled 4x4 -> 2x2, a newline
    normalize = processor_from_checkpoint(str(path)).normalize
    videos = torch.from_numpy(np.stack([normalize(f) for f in frames])).permute(0, 3, 1, 2)[None]
    hf = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    inputs = {**_hf_inputs("llava_onevision", [picture]), "pixel_values_videos": videos}
    tokens, logprobs = hf_greedy(hf, output.prompt_token_ids, inputs, 6)
    completion = output.outputs[0]
    assert list(completion.token_ids) == tokens
    np.testing.assert_allclose([s[t].logprob for s, t in zip(completion.logprobs, tokens)], logprobs,
                               atol=2e-4, rtol=0)
