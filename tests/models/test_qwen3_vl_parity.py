"""Qwen3-VL pieces equal transformers: checkpoint names, vision tower outputs
with their DeepStack rows (images and videos), interleaved M-RoPE, and the
prompt's position ids with video timestamps as text."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from foveal.config import CacheConfig, EngineConfig, MultimodalConfig, SchedulerConfig
from foveal.forward_context import AttentionMetadata, forward_context
from foveal.loader.hf_config import model_config_from_hf
from foveal.loader.weights import load_model
from foveal.models.qwen3 import InterleavedMRotaryEmbedding
from foveal.multimodal.inputs import MMFeature, PlaceholderRange
from foveal.multimodal.media.video import load_video, probe_video
from foveal.multimodal.processors import get_processor_family
from foveal.multimodal.processors.qwen3_vl import Qwen3VLImageProcessor, Qwen3VLVideoProcessor
from foveal.tokenizer import Tokenizer

FIRST_TEXT_TOKEN = 14


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
    from transformers import Qwen3VLForConditionalGeneration

    path = tiny_checkpoints("tiny-qwen3-vl")
    hf_model, info = Qwen3VLForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    config = model_config_from_hf(path)
    model = load_model(EngineConfig(config, CacheConfig(block_size=4), SchedulerConfig(), MultimodalConfig()))
    return path, hf_model.eval(), config, model


def _images(sizes):
    processor = Qwen3VLImageProcessor(min_pixels=32 * 32, max_pixels=256 * 256)
    rng = np.random.default_rng(0)
    return [processor.process(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
            for w, h in sizes]


def _video(num_frames: int, width: int, height: int):
    processor = Qwen3VLVideoProcessor.from_config({"size": {"shortest_edge": 1024,
                                                            "longest_edge": 8 * 96 * 96}})
    rng = np.random.default_rng(num_frames)
    source = {"frames": [rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
                         for _ in range(num_frames)], "fps": 1.0}
    info = probe_video(source, processor.sampling, 10 ** 9)
    return processor.process(load_video(source, info, num_frames, processor.sampling))


@torch.no_grad()
def test_embeddings_with_deepstack_rows_equal_transformers(models):
    _, hf_model, _, model = models
    images = _images([(100, 70), (64, 200), (250, 90)])
    features = [MMFeature("image", f"i{n}", PlaceholderRange(0, item.num_tokens), item.feature_data())
                for n, item in enumerate(images)]
    ours = model.embed_multimodal(features)
    theirs = hf_model.model.get_image_features(torch.cat([i.pixel_values for i in images]),
                                               torch.tensor([i.grid_thw for i in images]))
    assert len(theirs.deepstack_features) == 2
    for index, rows in enumerate(ours):
        deepstack = [rows_of_layer[index] for rows_of_layer in theirs.deepstack_features]
        expected = torch.cat([theirs.pooler_output[index], *deepstack], -1)
        assert rows.shape == (images[index].num_tokens, 3 * 64)
        torch.testing.assert_close(rows, expected, atol=2e-5, rtol=0)


def test_interleaved_mrope_equals_transformers():
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    for head_dim, section in ((16, [4, 2, 2]), (128, [24, 20, 20])):
        hf_config = Qwen3VLTextConfig(head_dim=head_dim, rope_parameters={
            "rope_type": "default", "rope_theta": 5e6, "mrope_section": section, "mrope_interleaved": True})
        positions = torch.randint(0, 500, (3, 1, 37))
        cos, sin = Qwen3VLTextRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32), positions)
        ours = InterleavedMRotaryEmbedding(head_dim, 5e6, tuple(section)).cos_sin(positions[:, 0])
        torch.testing.assert_close(ours[0], cos[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(ours[1], sin[0], atol=1e-6, rtol=0)


@torch.no_grad()
def test_positions_and_video_rows_equal_transformers(models, tmp_path):
    """Image + video (timestamps as text inside its range): M-RoPE ids equal
    get_rope_index, and the video range's rows are the tower's rows between the
    text's token embeddings."""
    from foveal.loader.tiny_tokenizer import write_tiny_tokenizer

    path, hf_model, config, model = models
    write_tiny_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_pretrained(tmp_path)
    image, video = _images([(90, 130)])[0], _video(5, 96, 64)
    prompt = ("Look<|vision_start|><|image_pad|><|vision_end|> then"
              "<|vision_start|><|video_pad|><|vision_end|> done")
    ids, features = get_processor_family("qwen3_vl").expander(tokenizer)(
        tokenizer.encode(prompt), {"image": (config.image_token_id, [image]),
                                   "video": (config.video_token_id, [video])})
    ours, delta = type(model).get_mrope_positions(config, ids, features)
    input_ids = torch.tensor([ids])
    types = (input_ids == config.image_token_id).long() + 2 * (input_ids == config.video_token_id).long()
    positions, deltas = hf_model.model.get_rope_index(
        input_ids, types, image_grid_thw=torch.tensor([image.grid_thw]),
        video_grid_thw=torch.tensor([video.grid_thw]))
    assert torch.equal(ours, positions[:, 0]) and delta == int(deltas.flatten()[0])

    video_feature = features[1]
    rows = model.embed_multimodal([video_feature])[0]  # (range, 3 * hidden)
    assert rows.shape[0] == video_feature.placeholder.length
    span = torch.tensor(ids[video_feature.placeholder.offset:video_feature.placeholder.end])
    visual = span == config.video_token_id
    theirs = hf_model.model.get_video_features(video.pixel_values_videos, torch.tensor([video.grid_thw]))
    torch.testing.assert_close(rows[visual, :64], theirs.pooler_output[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(rows[visual, 128:], theirs.deepstack_features[1][0], atol=2e-5, rtol=0)
    text_rows = hf_model.model.language_model.embed_tokens(span[~visual])
    torch.testing.assert_close(rows[~visual, :64], text_rows, atol=0, rtol=0)
    assert not rows[~visual, 64:].any()  # no DeepStack on text


@torch.no_grad()
def test_deepstack_columns_change_the_decoder_output(models):
    """The extra columns reach the decoder: zeroing them changes the hidden states."""
    _, _, _, model = models
    image = _images([(96, 96)])[0]
    rows = model.embed_multimodal([MMFeature("image", "i", PlaceholderRange(0, image.num_tokens),
                                             image.feature_data())])[0]
    positions = torch.arange(rows.shape[0])
    text = model.config.text
    caches = [torch.zeros(2, 8, 4, text.num_key_value_heads, text.head_dim)
              for _ in range(text.num_hidden_layers)]
    outputs = []
    for embeds in (rows, torch.cat([rows[:, :64], torch.zeros_like(rows[:, 64:])], -1)):
        n = embeds.shape[0]
        metadata = AttentionMetadata.from_arrays(
            np.arange(n), np.array([0, n]), np.array([n]), np.arange(8)[None].astype(np.int32), 4, "cpu")
        with forward_context(metadata, caches):
            outputs.append(model(embeds, positions))
    assert (outputs[0] - outputs[1]).abs().max() > 1e-3


def test_qwen3_vl_2b_preset_has_the_checkpoint_shapes():
    """`--dummy qwen3-vl-2b`: the same parameters as transformers' model of the config (2.13B)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from foveal.loader.hf_config import model_config_from_dict
    from foveal.loader.presets import get_preset
    from foveal.models.qwen3_vl import Qwen3VLForConditionalGeneration as Ours

    preset = get_preset("qwen3-vl-2b")
    with torch.device("meta"):
        ours = Ours(model_config_from_dict(preset))
        theirs = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**preset))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters())  # tied head counted once
    assert 2.12e9 < count < 2.14e9
