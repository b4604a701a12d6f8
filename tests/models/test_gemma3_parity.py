"""Gemma 3 in Foveal equals transformers on a tiny checkpoint whose sliding
window (16) is shorter than the prompt: weights under both name layouts,
logits through the paged path in chunks (images never split, context before
them cached), decode, pan-and-scan items, int8 KV, export."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from foveal.config import CacheConfig, EngineConfig, MultimodalConfig, SchedulerConfig
from foveal.forward_context import AttentionMetadata, forward_context
from foveal.loader.export import save_hf_checkpoint
from foveal.loader.hf_config import model_config_from_dict, model_config_from_hf
from foveal.loader.presets import get_preset
from foveal.loader.weights import load_model
from foveal.multimodal.inputs import BIDIRECTIONAL_KEY, MMFeature, PlaceholderRange

ATOL = 2e-4
BLOCK = 4
IMAGE, BOI, EOI = 12, 9, 10
TOKENS = 16  # per view


def _hf_model(hf_config: dict, seed: int = 0):
    config = Gemma3Config(**hf_config)
    config._attn_implementation = "sdpa"
    model = Gemma3ForConditionalGeneration(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-flat weights with clear logit margins
        for name, param in model.named_parameters():
            scale = 0.1 if param.dim() == 1 else min(0.2, param[0].numel() ** -0.5)
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return model


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    hf_config = get_preset("tiny-gemma3")
    hf_model = _hf_model(hf_config)
    path = str(tmp_path_factory.mktemp("gemma3"))
    hf_model.save_pretrained(path)
    model_config = model_config_from_hf(path)
    engine_config = EngineConfig(model_config, CacheConfig(block_size=BLOCK), SchedulerConfig(),
                                 MultimodalConfig())
    return hf_config, hf_model, path, load_model(engine_config)


def _views(count: int, seed: int) -> torch.Tensor:
    return torch.randn(count, 3, 112, 112, generator=torch.Generator().manual_seed(seed))


def _prompt() -> tuple[list[int], list[MMFeature], torch.Tensor]:
    """text (20) + image A (one view) + text + image B (base + 2 crops, text between)."""
    text = lambda start, n: list(range(start, start + n))  # noqa: E731
    ids = [0] + text(30, 19) + [BOI]
    a_offset = len(ids)
    ids += [IMAGE] * TOKENS + [EOI] + text(60, 9) + [BOI]
    b_offset = len(ids)
    b_runs = ((0, TOKENS), (TOKENS + 3, TOKENS), (2 * TOKENS + 6, TOKENS))
    ids += [IMAGE] * TOKENS + [EOI, 90, BOI] + [IMAGE] * TOKENS + [EOI, 91, BOI] + [IMAGE] * TOKENS
    b_length = len(ids) - b_offset
    ids += [EOI] + text(100, 12)
    pixels_a, pixels_b = _views(1, 1), _views(3, 2)
    features = [
        MMFeature("image", "a", PlaceholderRange(a_offset, TOKENS),
                  {"pixel_values": pixels_a, "num_crops": 0, BIDIRECTIONAL_KEY: ((0, TOKENS),),
                   "token_ids": tuple(ids[a_offset:a_offset + TOKENS])}),
        MMFeature("image", "b", PlaceholderRange(b_offset, b_length),
                  {"pixel_values": pixels_b, "num_crops": 2, BIDIRECTIONAL_KEY: b_runs,
                   "token_ids": tuple(ids[b_offset:b_offset + b_length])}),
    ]
    return ids, features, torch.cat([pixels_a, pixels_b])


@torch.no_grad()
def _hf_logits(hf_model, ids: list[int], pixels: torch.Tensor) -> torch.Tensor:
    input_ids = torch.tensor([ids])
    return hf_model(input_ids=input_ids, pixel_values=pixels,
                    token_type_ids=(input_ids == IMAGE).long()).logits[0]


class Paged:
    """One request through the paged attention path, chunk by chunk, blocks reversed."""

    def __init__(self, model, spans, kv_dtype=torch.float32, num_blocks: int = 64):
        text = model.config.text
        self.model, self.spans = model, spans
        shape = (2, num_blocks, BLOCK, text.num_key_value_heads, text.head_dim)
        self.kv = [torch.zeros(shape, dtype=kv_dtype) for _ in range(text.num_hidden_layers)]
        self.scales = None
        if kv_dtype == torch.int8:
            self.scales = [torch.zeros(shape[:-1], dtype=torch.float16) for _ in self.kv]
        self.table, self.done = list(range(num_blocks - 1, 0, -1)), 0

    @torch.no_grad()
    def step(self, embeds: torch.Tensor) -> torch.Tensor:
        start, end = self.done, self.done + embeds.shape[0]
        slots = [self.table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
        metadata = AttentionMetadata(
            torch.tensor(slots), torch.tensor([0, end - start], dtype=torch.int32),
            torch.tensor([end], dtype=torch.int32), torch.tensor([self.table], dtype=torch.int32),
            end - start, end, BLOCK, [0, end - start], [end])
        metadata.bidirectional_spans = [self.spans] if self.spans else None
        with forward_context(metadata, self.kv, self.scales):
            hidden = self.model(embeds, torch.arange(start, end))
        self.done = end
        return self.model.compute_logits(hidden)


@torch.no_grad()
def _embeddings(model, ids: list[int], features: list[MMFeature]) -> torch.Tensor:
    embeds = model.embed_input_ids(torch.tensor(ids))
    for feature, rows in zip(features, model.embed_multimodal(features)):
        embeds[feature.placeholder.offset:feature.placeholder.end] = rows
    return embeds


def _spans(features: list[MMFeature]) -> list[tuple[int, int]]:
    return [span for feature in features for span in feature.bidirectional_spans]


def test_both_weight_name_layouts_load_the_same_weights(ref, tmp_path):
    hf_config, hf_model, path, model = ref
    saved = load_file(os.path.join(path, "model.safetensors"))
    assert "language_model.model.layers.0.self_attn.q_norm.weight" in saved  # the older names
    tensors = {name: t.detach().clone() for name, t in hf_model.state_dict().items()}
    assert "model.language_model.layers.0.self_attn.q_norm.weight" in tensors  # >= 4.52 names
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = EngineConfig(model_config_from_dict(hf_config, path=str(tmp_path)), CacheConfig(),
                          SchedulerConfig(), MultimodalConfig())
    expected = dict(model.named_parameters())
    for name, param in load_model(config).named_parameters():
        assert torch.equal(param, expected[name]), name


def test_chunked_prefill_and_decode_match_transformers(ref):
    _, hf_model, _, model = ref
    ids, features, pixels = _prompt()
    expected = _hf_logits(hf_model, ids, pixels)
    embeds = _embeddings(model, ids, features)
    paged = Paged(model, _spans(features))
    # chunks end before, at and after images, never inside a run; context is cached
    bounds = [0, 7, 21, 40, 47, 48, 66, 67, 86, len(ids)]
    logits = torch.cat([paged.step(embeds[a:b]) for a, b in zip(bounds, bounds[1:])])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)
    for _ in range(3):  # decode: one token a step, the window sliding past the images
        ids.append(int(logits[-1].argmax()))
        logits = paged.step(model.embed_input_ids(torch.tensor(ids[-1:])))
        torch.testing.assert_close(logits[-1], _hf_logits(hf_model, ids, pixels)[-1],
                                   atol=ATOL, rtol=1e-4)


def test_a_prefix_hit_inside_an_image_resumes_exactly(ref):
    # image B's first run is [48, 64): KV of 48..55 computed with the whole run in
    # one step is final; a request reusing it computes 56.. in one step
    _, hf_model, _, model = ref
    ids, features, pixels = _prompt()
    expected = _hf_logits(hf_model, ids, pixels)
    embeds = _embeddings(model, ids, features)
    first = Paged(model, _spans(features))
    for a, b in [(0, 48), (48, 66)]:
        first.step(embeds[a:b])
    resumed = Paged(model, _spans(features))
    resumed.kv = [kv.clone() for kv in first.kv]  # the same blocks, as a prefix hit shares them
    resumed.done = 56
    torch.testing.assert_close(resumed.step(embeds[56:66]), expected[56:66], atol=ATOL, rtol=1e-4)


def test_images_need_their_bidirectional_mask(ref):
    _, hf_model, _, model = ref
    ids, features, pixels = _prompt()
    expected = _hf_logits(hf_model, ids, pixels)
    causal = Paged(model, spans=[]).step(_embeddings(model, ids, features))
    assert torch.allclose(causal[:20], expected[:20], atol=ATOL)  # before any image
    assert not torch.allclose(causal[21:37], expected[21:37], atol=1e-2)  # inside image A


def test_sliding_window_matters_on_this_prompt(ref):
    _, hf_model, path, model = ref
    ids, features, pixels = _prompt()
    expected = _hf_logits(hf_model, ids, pixels)
    for layer in model.language_model.layers:
        layer.self_attn.attn.sliding_window, layer.self_attn.attn._backends = None, {}
    try:
        unwindowed = Paged(model, _spans(features)).step(_embeddings(model, ids, features))
    finally:
        for layer in model.language_model.layers:
            attn = layer.self_attn
            attn.attn.sliding_window = 16 if attn.is_sliding else None
            attn.attn._backends = {}
    assert not torch.allclose(unwindowed[-10:], expected[-10:], atol=1e-2)


def test_int8_kv_follows_the_same_masks(ref):
    _, hf_model, _, model = ref
    ids, features, pixels = _prompt()
    expected = _hf_logits(hf_model, ids, pixels)
    embeds = _embeddings(model, ids, features)
    paged = Paged(model, _spans(features), kv_dtype=torch.int8)
    bounds = [0, 21, 40, 66, len(ids)]
    logits = torch.cat([paged.step(embeds[a:b]) for a, b in zip(bounds, bounds[1:])])
    torch.testing.assert_close(logits, expected, atol=5e-2, rtol=0)  # int8 rounding only
    causal = Paged(model, spans=[], kv_dtype=torch.int8).step(embeds)
    assert not torch.allclose(causal[21:37], expected[21:37], atol=0.2)  # the mask is in use


def test_sparse_hub_config_takes_gemma3_defaults():
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
           "image_token_index": 262144, "mm_tokens_per_image": 256,
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                           "model_type": "gemma3_text", "num_hidden_layers": 34,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16,
                             "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
    config = model_config_from_dict(hub)
    settings = config.family_config
    assert config.text.vocab_size == 262_208 and config.text.head_dim == 256
    assert config.text.rope_theta == 1_000_000.0 and settings.local_rope_theta == 10_000.0
    assert settings.global_rope_scaling == 8.0 and settings.sliding_window == 1024
    assert [i for i, s in enumerate(settings.sliding_layers) if not s] == [5, 11, 17, 23, 29]
    assert config.eos_token_ids == (1, 106) and config.vision.spatial_merge_size == 4
    preset = model_config_from_dict(get_preset("gemma-3-4b"))
    assert (preset.text, preset.vision, settings) == (
        config.text, config.vision, preset.family_config.__class__(
            **{**vars(preset.family_config), "boi_token_id": 255999, "eoi_token_id": 256000}))


def test_exported_weights_give_the_same_logits_in_transformers(ref, tmp_path):
    hf_config, _, _, _ = ref
    config = EngineConfig(model_config_from_dict(hf_config), CacheConfig(block_size=BLOCK),
                          SchedulerConfig(), MultimodalConfig(), load_format="dummy")
    model = load_model(config)
    save_hf_checkpoint(model, hf_config, str(tmp_path))
    hf_model = Gemma3ForConditionalGeneration.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids, features, pixels = _prompt()
    logits = Paged(model, _spans(features)).step(_embeddings(model, ids, features))
    torch.testing.assert_close(logits, _hf_logits(hf_model, ids, pixels), atol=ATOL, rtol=1e-4)
