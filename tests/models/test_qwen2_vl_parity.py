"""Qwen2-VL / Qwen2.5-VL in Foveal equal transformers: weights, logits
through the paged path (one chunk, odd chunks, decode), M-RoPE ids, export."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from foveal.config import CacheConfig, EngineConfig, MultimodalConfig, SchedulerConfig
from foveal.errors import CheckpointError
from foveal.forward_context import AttentionMetadata, forward_context
from foveal.loader.export import save_hf_checkpoint
from foveal.loader.hf_config import model_config_from_dict, model_config_from_hf
from foveal.loader.presets import get_preset
from foveal.loader.weights import load_model
from foveal.multimodal.inputs import MMFeature, PlaceholderRange
from tests.models.hf_reference import (
    hf_logits,
    hf_model_from_preset,
    hf_rope_index,
    image_inputs,
    prompt_with_images,
)

PRESETS = ["tiny-qwen2-vl", "tiny-qwen2.5-vl"]
ATOL = 2e-4
BLOCK_SIZE = 4


def engine_config(model_config, load_format="auto") -> EngineConfig:
    return EngineConfig(model_config, CacheConfig(block_size=BLOCK_SIZE), SchedulerConfig(),
                        MultimodalConfig(), load_format=load_format)


def features_for(pixel_values, grid_thw, placeholders) -> list[MMFeature]:
    features, start = [], 0
    for index, (offset, length) in enumerate(placeholders):
        num_patches = int(grid_thw[index].prod())
        data = {"pixel_values": pixel_values[start:start + num_patches],
                "grid_thw": tuple(grid_thw[index].tolist())}
        features.append(MMFeature("image", f"img{index}", PlaceholderRange(offset, length), data))
        start += num_patches
    return features


@pytest.fixture(scope="module", params=PRESETS)
def reference(request, tmp_path_factory):
    hf_config = get_preset(request.param)
    hf_model = hf_model_from_preset(hf_config)
    path = str(tmp_path_factory.mktemp(request.param))
    hf_model.save_pretrained(path)
    model_config = model_config_from_hf(path)
    pixel_values, grid_thw = image_inputs([(90, 60), (64, 150)])
    token_ids, placeholders = prompt_with_images(hf_config, grid_thw, [5, 3, 4])
    return SimpleNamespace(
        name=request.param, hf_config=hf_config, hf_model=hf_model, path=path,
        model_config=model_config, model=load_model(engine_config(model_config)),
        pixel_values=pixel_values, grid_thw=grid_thw, token_ids=token_ids,
        features=features_for(pixel_values, grid_thw, placeholders))


class PagedSequence:
    """One request run through the paged attention path, chunk by chunk,
    with its KV blocks scattered over the cache in reverse order."""

    def __init__(self, model, num_blocks: int = 40):
        text = model.config.text
        self.model = model
        self.kv_caches = [torch.zeros(2, num_blocks, BLOCK_SIZE, text.num_key_value_heads, text.head_dim)
                          for _ in range(text.num_hidden_layers)]
        self.block_table = list(range(num_blocks - 1, 0, -1))
        self.num_computed = 0

    @torch.no_grad()
    def step(self, inputs_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run (n, hidden) new tokens -> (n, vocab) logits."""
        start, num_new = self.num_computed, inputs_embeds.shape[0]
        context = start + num_new
        slots = [self.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                 for p in range(start, context)]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor([0, num_new], dtype=torch.int32),
            seq_lens=torch.tensor([context], dtype=torch.int32),
            block_tables=torch.tensor([self.block_table], dtype=torch.int32),
            max_query_len=num_new, max_seq_len=context, block_size=BLOCK_SIZE,
            query_start_loc_cpu=[0, num_new], seq_lens_cpu=[context])
        with forward_context(metadata, self.kv_caches):
            hidden = self.model(inputs_embeds, positions)
        self.num_computed = context
        return self.model.compute_logits(hidden)


@torch.no_grad()
def prompt_embeddings(ref) -> tuple[torch.Tensor, torch.Tensor, int]:
    model = ref.model
    embeds = model.embed_input_ids(torch.tensor(ref.token_ids))
    for feature, rows in zip(ref.features, model.embed_multimodal(ref.features)):
        embeds[feature.placeholder.offset:feature.placeholder.end] = rows
    positions, delta = model.get_mrope_positions(ref.model_config, ref.token_ids, ref.features)
    return embeds, positions, delta


def test_transformers_saved_checkpoint_loads(reference):
    # save_pretrained writes the pre-4.52 names (visual.*, model.*).
    saved = load_file(os.path.join(reference.path, "model.safetensors"))
    assert "visual.patch_embed.proj.weight" in saved and "model.norm.weight" in saved
    hf_state = reference.hf_model.state_dict()
    embed = reference.model.language_model.embed_tokens.weight
    assert torch.equal(embed, hf_state["model.language_model.embed_tokens.weight"])
    q = hf_state["model.language_model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(reference.model.language_model.layers[0].self_attn.qkv_proj.weight[: q.shape[0]], q)


def test_checkpoint_with_new_names_loads_the_same_weights(reference, tmp_path):
    # transformers >= 4.52 names: model.visual.*, model.language_model.*, lm_head.*
    tensors = {name: t.detach().clone() for name, t in reference.hf_model.state_dict().items()}
    assert "model.visual.patch_embed.proj.weight" in tensors
    save_file(tensors, str(tmp_path / "model.safetensors"))
    new_model = load_model(engine_config(model_config_from_dict(reference.hf_config, path=str(tmp_path))))
    expected = dict(reference.model.named_parameters())
    for name, param in new_model.named_parameters():
        assert torch.equal(param, expected[name]), name


def test_prefill_in_one_chunk_matches_transformers(reference):
    expected = hf_logits(reference.hf_model, reference.hf_config, reference.token_ids,
                         reference.pixel_values, reference.grid_thw)
    embeds, positions, _ = prompt_embeddings(reference)
    logits = PagedSequence(reference.model).step(embeds, positions)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)


def test_chunked_prefill_then_decode_matches_transformers(reference):
    hf_model, hf_config = reference.hf_model, reference.hf_config
    token_ids = list(reference.token_ids)
    expected = hf_logits(hf_model, hf_config, token_ids, reference.pixel_values, reference.grid_thw)
    embeds, positions, delta = prompt_embeddings(reference)
    sequence = PagedSequence(reference.model)
    bounds = [0, 7, 10, 23, 26, len(token_ids)]  # 7..10 and 23..26 cut through image ranges
    for start, end in zip(bounds, bounds[1:]):
        logits = sequence.step(embeds[start:end], positions[:, start:end])
        torch.testing.assert_close(logits[-1], expected[end - 1], atol=ATOL, rtol=1e-4)
    for _ in range(3):
        token_ids.append(int(logits[-1].argmax()))
        index = len(token_ids) - 1
        new_embeds = reference.model.embed_input_ids(torch.tensor(token_ids[-1:]))
        logits = sequence.step(new_embeds, torch.full((3, 1), index + delta))
        expected = hf_logits(hf_model, hf_config, token_ids, reference.pixel_values, reference.grid_thw)
        torch.testing.assert_close(logits[-1], expected[-1], atol=ATOL, rtol=1e-4)
        assert int(logits[-1].argmax()) == int(expected[-1].argmax())


@pytest.mark.parametrize("text_lengths", [[5, 3, 4], [0, 0, 0], [2, 6, 1]])
def test_mrope_positions_equal_transformers_get_rope_index(reference, text_lengths):
    token_ids, placeholders = prompt_with_images(reference.hf_config, reference.grid_thw, text_lengths)
    features = features_for(reference.pixel_values, reference.grid_thw, placeholders)
    positions, delta = reference.model.get_mrope_positions(reference.model_config, token_ids, features)
    expected, expected_delta = hf_rope_index(reference.hf_model, reference.hf_config, token_ids,
                                             reference.grid_thw)
    assert torch.equal(positions, expected)
    assert delta == expected_delta


def test_mrope_positions_of_text_only_prompt_are_arange(reference):
    positions, delta = reference.model.get_mrope_positions(reference.model_config, [20, 21, 22], [])
    assert torch.equal(positions, torch.arange(3).expand(3, -1))
    assert delta == 0


def test_batched_images_embed_like_single_images(reference):
    together = reference.model.embed_multimodal(reference.features)
    for feature, rows in zip(reference.features, together):
        alone = reference.model.embed_multimodal([feature])[0]
        assert rows.shape == (feature.placeholder.length, reference.model_config.text.hidden_size)
        torch.testing.assert_close(rows, alone, atol=1e-5, rtol=1e-5)


def test_exported_dummy_weights_give_the_same_logits_in_transformers(reference, tmp_path):
    from transformers import AutoModelForImageTextToText

    model = load_model(engine_config(model_config_from_dict(reference.hf_config), load_format="dummy"))
    save_hf_checkpoint(model, reference.hf_config, str(tmp_path))
    hf_model = AutoModelForImageTextToText.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    expected = hf_logits(hf_model, reference.hf_config, reference.token_ids,
                         reference.pixel_values, reference.grid_thw)
    reference_with_dummy = SimpleNamespace(**{**vars(reference), "model": model})
    embeds, positions, _ = prompt_embeddings(reference_with_dummy)
    logits = PagedSequence(model).step(embeds, positions)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)


def _write_modified_checkpoint(reference, tmp_path, edit) -> str:
    tensors = load_file(os.path.join(reference.path, "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def test_missing_weight_raises_checkpoint_error(reference, tmp_path):
    def drop_down_proj(tensors):
        tensors.pop(next(name for name in tensors if "layers.0.mlp.down_proj.weight" in name))

    path = _write_modified_checkpoint(reference, tmp_path, drop_down_proj)
    with pytest.raises(CheckpointError, match="down_proj"):
        load_model(engine_config(model_config_from_dict(reference.hf_config, path=path)))


def test_unexpected_weight_raises_checkpoint_error(reference, tmp_path):
    def add_extra(tensors):
        tensors["model.layers.0.extra_gate.weight"] = torch.zeros(2)

    path = _write_modified_checkpoint(reference, tmp_path, add_extra)
    with pytest.raises(CheckpointError, match="extra_gate"):
        load_model(engine_config(model_config_from_dict(reference.hf_config, path=path)))
