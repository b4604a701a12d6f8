"""Config parsing, checkpoint discovery, dummy weights, presets, registry."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from foveal.config import CacheConfig, EngineConfig, MultimodalConfig, SchedulerConfig
from foveal.errors import CheckpointError, ConfigError
from foveal.loader.export import hf_state_dict
from foveal.loader.hf_config import model_config_from_dict, model_config_from_hf
from foveal.loader.presets import get_preset, preset_names
from foveal.loader.weights import build_model, load_model
from foveal.models.registry import get_model_class


def engine_config(model_config, load_format="auto", device="cpu", seed=0,
                  dtype="float32") -> EngineConfig:
    return EngineConfig(model_config, CacheConfig(), SchedulerConfig(), MultimodalConfig(),
                        load_format=load_format, device=device, seed=seed, dtype=dtype)


def flat_layout(nested: dict) -> dict:
    """The pre-transformers-5 layout: text fields at top level, rope_scaling."""
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    text = dict(nested["text_config"])
    rope = text.pop("rope_parameters")
    text.pop("model_type")
    flat.update(text, rope_theta=rope["rope_theta"],
                rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    return flat


@pytest.mark.parametrize("preset", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "qwen2.5-vl-7b"])
def test_flat_and_nested_layouts_parse_to_the_same_config(preset):
    nested = get_preset(preset)
    assert model_config_from_dict(flat_layout(nested)) == model_config_from_dict(nested)


def test_qwen2_vl_vision_width_comes_from_embed_dim_and_mlp_ratio():
    vision = model_config_from_dict(get_preset("small")).vision
    assert (vision.hidden_size, vision.intermediate_size, vision.out_hidden_size) == (768, 3072, 896)
    assert vision.window_size == 0 and vision.variant == "qwen2_vl"


def test_qwen2_5_vl_vision_reads_window_fields():
    vision = model_config_from_dict(get_preset("qwen2.5-vl-3b")).vision
    assert (vision.hidden_size, vision.intermediate_size, vision.out_hidden_size) == (1280, 3420, 2048)
    assert vision.window_size == 112 and vision.fullatt_block_indexes == (7, 15, 23, 31)


@pytest.mark.parametrize("generation_eos, expected", [([2, 0], (2, 0)), (7, (7, 2))])
def test_eos_ids_merge_generation_config_and_config(tmp_path, generation_eos, expected):
    (tmp_path / "config.json").write_text(json.dumps(get_preset("tiny-qwen2-vl")))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    config = model_config_from_hf(str(tmp_path))
    assert config.eos_token_ids == expected and config.path == str(tmp_path)


def test_unsupported_architecture_lists_supported_ones():
    hf = {**get_preset("tiny-qwen2-vl"), "architectures": ["LlamaForCausalLM"]}
    with pytest.raises(ConfigError, match="Qwen2_5_VLForConditionalGeneration"):
        model_config_from_dict(hf)


def test_mrope_section_must_sum_to_half_head_dim():
    hf = get_preset("tiny-qwen2-vl")
    hf["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 2]
    with pytest.raises(ConfigError, match="head_dim // 2 = 8"):
        model_config_from_dict(hf)


def test_missing_config_json_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        model_config_from_hf(str(tmp_path))


def test_registry_rejects_unknown_architecture():
    with pytest.raises(ConfigError, match="Qwen2VLForConditionalGeneration"):
        get_model_class("GPT2LMHeadModel")


def test_presets_use_the_tiny_tokenizer_special_ids():
    """Every preset runs with the tiny tokenizer: its ids where the family has the token,
    -1 where it has none (no video for LLaVA-1.5 / NeXT and Gemma 3, no vision markers
    for LLaVA)."""
    for name in preset_names():
        config = model_config_from_dict(get_preset(name))
        assert config.image_token_id == 12 and config.video_token_id in (13, -1), name
        assert (config.vision_start_token_id, config.vision_end_token_id) in ((9, 10), (-1, -1)), name
        assert config.eos_token_ids == (2,), name
        if "qwen" in name or name in ("small", "demo"):
            assert (config.video_token_id, config.vision_start_token_id) == (13, 9), name


def test_small_preset_has_qwen2_0_5b_text_dims_and_about_485m_params():
    config = model_config_from_dict(get_preset("small"))
    text = config.text
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads,
            text.num_key_value_heads, text.intermediate_size, text.vocab_size) == (896, 24, 14, 2, 4864, 32000)
    assert text.tie_word_embeddings and text.mrope_section == (8, 12, 12)
    model = build_model(engine_config(config, device="meta"))
    assert 480e6 < sum(p.numel() for p in model.parameters()) < 490e6


def test_unknown_preset_is_a_config_error():
    with pytest.raises(ConfigError, match="tiny-qwen2-vl"):
        get_preset("huge")


def test_dummy_weights_are_deterministic_and_seed_dependent():
    config = model_config_from_dict(get_preset("tiny-qwen2.5-vl"))
    first, second = (load_model(engine_config(config, "dummy")) for _ in range(2))
    other_seed = load_model(engine_config(config, "dummy", seed=1))
    name = "language_model.layers.0.self_attn.qkv_proj.weight"
    params = [dict(m.named_parameters())[name] for m in (first, second, other_seed)]
    assert torch.equal(params[0], params[1]) and not torch.equal(params[0], params[2])
    assert torch.equal(first.language_model.norm.weight, torch.ones(64))


def test_dummy_weights_give_non_flat_logits():
    config = model_config_from_dict(get_preset("tiny-qwen2-vl"))
    model = load_model(engine_config(config, "dummy"))
    from foveal.forward_context import forward_context

    with torch.no_grad(), forward_context(None, []):
        hidden = model(model.embed_input_ids(torch.arange(20, 40)), torch.arange(20))
        logits = model.compute_logits(hidden)
    top2 = logits.topk(2, dim=-1).values
    assert logits.std() > 0.5 and (top2[:, 0] - top2[:, 1]).mean() > 0.1


def test_sharded_checkpoint_loads_through_its_index(tmp_path):
    config = model_config_from_dict(get_preset("tiny-qwen2-vl"), path=str(tmp_path))
    source = load_model(engine_config(config, "dummy", seed=3))
    tensors = hf_state_dict(source)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(tmp_path / shard))
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_model(engine_config(config))
    for (name, param), expected in zip(loaded.named_parameters(), source.parameters()):
        assert torch.equal(param, expected), name


def test_export_writes_shards_that_foveal_and_transformers_load(tmp_path):
    """Past max_shard_bytes the export writes transformers' sharded layout (bf16 here, as
    `foveal tiny-model --dtype bfloat16` stores a 7B preset)."""
    import transformers

    from foveal.loader.export import save_hf_checkpoint

    hf_config = {**get_preset("tiny-qwen2-vl"), "dtype": "bfloat16"}
    config = model_config_from_dict(hf_config, path=str(tmp_path))
    source = load_model(engine_config(config, "dummy", seed=5, dtype="bfloat16"))
    save_hf_checkpoint(source, hf_config, str(tmp_path), max_shard_bytes=200_000)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert not (tmp_path / "model.safetensors").exists()
    loaded = load_model(engine_config(config, dtype="bfloat16"))
    for (name, param), expected in zip(loaded.named_parameters(), source.parameters()):
        assert param.dtype == torch.bfloat16 and torch.equal(param, expected), name
    hf = transformers.Qwen2VLForConditionalGeneration.from_pretrained(str(tmp_path))
    assert hf.dtype == torch.bfloat16
    theirs = hf.state_dict()
    for name, tensor in hf_state_dict(source).items():
        assert torch.equal(theirs[name], tensor), name


def test_folder_without_safetensors_is_a_checkpoint_error(tmp_path):
    config = model_config_from_dict(get_preset("tiny-qwen2-vl"), path=str(tmp_path))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(engine_config(config))


def test_unknown_load_format_is_a_config_error():
    config = model_config_from_dict(get_preset("tiny-qwen2-vl"))
    with pytest.raises(ConfigError, match="dummy"):
        load_model(engine_config(config, "pickle"))


def test_build_dummy_model_matches_load_model_dummy():
    from foveal.loader.weights import build_dummy_model

    hf = get_preset("tiny-qwen2-vl")
    direct = build_dummy_model(hf, seed=2)
    via_engine = load_model(engine_config(model_config_from_dict(hf), "dummy", seed=2))
    for a, b in zip(direct.parameters(), via_engine.parameters()):
        assert torch.equal(a, b)
