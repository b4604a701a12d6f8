"""GGUF export for the llama.cpp peer benchmark: every checkpoint tensor lands under
llama.cpp's name with its values, the metadata describes the model, the vocabulary is
the tokenizer's."""
import json

import gguf
import numpy as np
import pytest
from safetensors import safe_open

from foveal.bench.gguf_export import export_gguf
from foveal.errors import CheckpointError, ConfigError
from foveal.loader.tiny_model import ensure_tiny_checkpoint




@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("tq2") / "m", "tiny-qwen2-vl")


def _checkpoint(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        return {name: handle.get_tensor(name).float().numpy() for name in handle.keys()}


def _tensors(path):
    reader = gguf.GGUFReader(str(path))
    return reader, {t.name: t for t in reader.tensors}


def _values(tensor):
    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))


def _field(reader, key):
    part = reader.fields[key]
    values = [part.parts[i] for i in part.data]
    if len(values) == 1 and part.types[0] != gguf.GGUFValueType.ARRAY:
        value = values[0]
        return bytes(value).decode() if part.types[0] == gguf.GGUFValueType.STRING else value[0]
    if part.types[-1] == gguf.GGUFValueType.STRING:
        return [bytes(v).decode() for v in values]
    return [v[0] for v in values]


def test_f32_export_keeps_every_tensor_exactly(qwen2_vl, tmp_path):
    files = export_gguf(qwen2_vl, tmp_path, "f32")
    original = _checkpoint(qwen2_vl)
    _, text = _tensors(files.model)
    _, vision = _tensors(files.mmproj)
    language = {k: v for k, v in original.items() if not k.startswith("model.visual.")}
    assert len(text) == len(language)
    np.testing.assert_array_equal(_values(text["token_embd.weight"]),
                                  original["model.language_model.embed_tokens.weight"])
    np.testing.assert_array_equal(_values(text["blk.1.attn_k.bias"]),
                                  original["model.language_model.layers.1.self_attn.k_proj.bias"])
    np.testing.assert_array_equal(_values(text["blk.0.ffn_down.weight"]),
                                  original["model.language_model.layers.0.mlp.down_proj.weight"])
    # the fused qkv becomes three tensors, the 3-D patch kernel two 2-D ones
    visual = {k: v for k, v in original.items() if k.startswith("model.visual.")}
    qkv = sum(1 for k in visual if ".qkv." in k)
    assert len(vision) == len(visual) + 2 * qkv + 1
    fused = original["model.visual.blocks.1.attn.qkv.weight"]
    width = fused.shape[0] // 3
    for index, part in enumerate("qkv"):
        np.testing.assert_array_equal(_values(vision[f"v.blk.1.attn_{part}.weight"]),
                                      fused[index * width:(index + 1) * width])
    patch = original["model.visual.patch_embed.proj.weight"]
    np.testing.assert_array_equal(_values(vision["v.patch_embd.weight"]), patch[:, :, 0])
    np.testing.assert_array_equal(_values(vision["v.patch_embd.weight.1"]), patch[:, :, 1])
    np.testing.assert_array_equal(_values(vision["mm.2.weight"]),
                                  original["model.visual.merger.mlp.2.weight"])
    np.testing.assert_array_equal(_values(vision["v.post_ln.weight"]),
                                  original["model.visual.merger.ln_q.weight"])


def test_metadata_and_vocabulary_describe_the_checkpoint(qwen2_vl, tmp_path):
    files = export_gguf(qwen2_vl, tmp_path, "f32")
    config = json.loads((qwen2_vl / "config.json").read_text())
    text = config["text_config"]
    reader, _ = _tensors(files.model)
    assert _field(reader, "general.architecture") == "qwen2vl"
    assert _field(reader, "qwen2vl.block_count") == text["num_hidden_layers"]
    assert _field(reader, "qwen2vl.attention.head_count_kv") == text["num_key_value_heads"]
    assert _field(reader, "qwen2vl.rope.dimension_sections") == \
        text["rope_parameters"]["mrope_section"] + [0]
    tokenizer = json.loads((qwen2_vl / "tokenizer.json").read_text())
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == text["vocab_size"]
    for token, index in tokenizer["model"]["vocab"].items():
        assert tokens[index] == token
    for added in tokenizer["added_tokens"]:
        assert tokens[added["id"]] == added["content"]
    assert _field(reader, "tokenizer.ggml.pre") == "qwen2"
    assert len(_field(reader, "tokenizer.ggml.merges")) == len(tokenizer["model"]["merges"])
    mmproj, _ = _tensors(files.mmproj)
    assert _field(mmproj, "clip.projector_type") == "qwen2vl_merger"
    assert _field(mmproj, "clip.vision.block_count") == config["vision_config"]["depth"]
    assert _field(mmproj, "clip.vision.projection_dim") == text["hidden_size"]


def test_q8_0_and_f16_weights_stay_close_and_norms_stay_f32(qwen2_vl, tmp_path):
    original = _checkpoint(qwen2_vl)["model.language_model.layers.0.mlp.up_proj.weight"]
    for weights, kind, tolerance in (("q8_0", "Q8_0", 0.01), ("f16", "F16", 1e-3)):
        files = export_gguf(qwen2_vl, tmp_path, weights)
        _, text = _tensors(files.model)
        tensor = text["blk.0.ffn_up.weight"]
        assert tensor.tensor_type.name == kind
        error = np.abs(_values(tensor) - original).max() / np.abs(original).max()
        assert 0 < error < tolerance, weights
        assert text["blk.0.attn_norm.weight"].tensor_type.name == "F32"
        assert text["blk.0.attn_q.bias"].tensor_type.name == "F32"
        assert files.mmproj.name == "mmproj-f16.gguf"


def test_qwen2_5_vl_mmproj_carries_its_window_pattern(tmp_path):
    model = ensure_tiny_checkpoint(tmp_path / "m", "tiny-qwen2.5-vl")
    config = json.loads((model / "config.json").read_text())
    config["vision_config"]["window_size"] = 112  # real checkpoints' window, llama.cpp's
    (model / "config.json").write_text(json.dumps(config))
    vision = config["vision_config"]
    files = export_gguf(model, tmp_path / "gguf", "f32")
    reader, tensors = _tensors(files.mmproj)
    assert _field(reader, "clip.projector_type") == "qwen2.5vl_merger"
    assert _field(reader, "clip.vision.n_wa_pattern") == vision["fullatt_block_indexes"][0] + 1
    assert "v.blk.0.ffn_gate.weight" in tensors
    _, text = _tensors(files.model)
    assert "output.weight" in text  # this preset does not tie its LM head


def test_qwen2_5_vl_with_a_window_llama_cpp_does_not_have_is_refused(tmp_path):
    model = ensure_tiny_checkpoint(tmp_path / "m", "tiny-qwen2.5-vl")  # a 56-pixel window
    with pytest.raises(CheckpointError, match="112-pixel windows"):
        export_gguf(model, tmp_path / "gguf", "f32")


def test_other_families_and_weight_types_are_refused(tmp_path):
    gemma = ensure_tiny_checkpoint(tmp_path / "g", "tiny-gemma3")
    with pytest.raises(ConfigError, match="Qwen2-VL"):
        export_gguf(gemma, tmp_path / "out")
    with pytest.raises(ConfigError, match="q8_0"):
        export_gguf(gemma, tmp_path / "out", "q4_k")
