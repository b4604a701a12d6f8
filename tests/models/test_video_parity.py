"""Video at the model level equals transformers: vision-tower embeddings of
video patches, and M-RoPE ids (Qwen2.5-VL's time-aligned temporal axis)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from foveal.config import CacheConfig, EngineConfig, MultimodalConfig, SchedulerConfig
from foveal.loader.hf_config import model_config_from_hf
from foveal.loader.presets import get_preset
from foveal.loader.weights import load_model
from foveal.multimodal.inputs import MMFeature, PlaceholderRange
from foveal.multimodal.media.video import load_video, probe_video
from foveal.multimodal.processors.qwen2_vl import Qwen2VLImageProcessor
from foveal.multimodal.processors.qwen2_vl_video import Qwen2VLVideoProcessor
from tests.models.hf_reference import FIRST_TEXT_TOKEN, hf_model_from_preset, mm_token_type_ids

PRESETS = ["tiny-qwen2-vl", "tiny-qwen2.5-vl"]


def processed_video(num_frames: int, fps: float, width: int, height: int, seed: int):
    rng = np.random.default_rng(seed)
    frames = [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(num_frames)]
    processor = Qwen2VLVideoProcessor(frame=Qwen2VLImageProcessor(max_pixels=28 * 28 * 16), fps=fps)
    source = {"frames": frames, "fps": fps}
    info = probe_video(source, processor.sampling, 10 ** 9)
    return processor.process(load_video(source, info, num_frames, processor.sampling))


@pytest.fixture(scope="module", params=PRESETS)
def models(request, tmp_path_factory):
    hf_config = get_preset(request.param)
    hf_model = hf_model_from_preset(hf_config)
    path = str(tmp_path_factory.mktemp(request.param))
    hf_model.save_pretrained(path)
    config = model_config_from_hf(path)
    engine_config = EngineConfig(config, CacheConfig(block_size=4), SchedulerConfig(), MultimodalConfig())
    return hf_config, hf_model, config, load_model(engine_config)


def video_feature(video, offset: int) -> MMFeature:
    return MMFeature("video", video.mm_hash, PlaceholderRange(offset, video.num_tokens), video.feature_data())


@torch.no_grad()
def test_video_embeddings_match_transformers(models):
    hf_config, hf_model, config, model = models
    videos = [processed_video(4, 2.0, 84, 56, seed=0), processed_video(6, 1.5, 56, 112, seed=1)]
    ours = model.embed_multimodal([video_feature(v, 0) for v in videos])
    pixels = torch.cat([v.pixel_values_videos for v in videos])
    grid = torch.tensor([v.grid_thw for v in videos])
    theirs = hf_model.model.get_video_features(pixels, grid).pooler_output
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=0)


@pytest.mark.parametrize("fps", [0.5, 1.0, 1.5, 3.0])
def test_mrope_positions_with_video_and_image_match_get_rope_index(models, fps):
    hf_config, hf_model, config, model = models
    video = processed_video(6, fps, 84, 56, seed=2)
    image_grid = (1, 4, 6)
    start, end = hf_config["vision_start_token_id"], hf_config["vision_end_token_id"]
    text = list(range(FIRST_TEXT_TOKEN, FIRST_TEXT_TOKEN + 5))
    image_len = 6
    ids = text + [start] + [hf_config["image_token_id"]] * image_len + [end] + text[:3] + [start]
    video_offset = len(ids)
    ids += [hf_config["video_token_id"]] * video.num_tokens + [end] + text
    features = [MMFeature("image", "i", PlaceholderRange(len(text) + 1, image_len), {"grid_thw": image_grid}),
                video_feature(video, video_offset)]
    ours, delta = type(model).get_mrope_positions(config, ids, features)
    positions, deltas = hf_model.model.get_rope_index(
        torch.tensor([ids]), mm_token_type_ids(hf_config, ids), image_grid_thw=torch.tensor([image_grid]),
        video_grid_thw=torch.tensor([video.grid_thw]),
        second_per_grid_ts=torch.tensor([video.second_per_grid_t]))
    assert torch.equal(ours, positions[:, 0]) and delta == int(deltas.flatten()[0])
