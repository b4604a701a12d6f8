"""GGUF files from a Hugging Face Qwen2-VL / Qwen2.5-VL checkpoint, for the llama.cpp
peer benchmark: the language model (arch `qwen2vl`) at f32, f16 or q8_0 and the vision
tower with its merger as an `mmproj` file, written with the `gguf` package.

Tensor names come from gguf's own name map. Two tensors need reshaping on the way: the
vision blocks' fused qkv projection is split into q, k and v, and the Conv3d patch
embedding (temporal patch 2) becomes two Conv2d kernels, one per frame of the pair.
Norms, biases and the position embedding stay f32, as llama.cpp's converter keeps them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from foveal.errors import CheckpointError, ConfigError

WEIGHT_TYPES = ("f32", "f16", "q8_0")
_FAMILIES = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class GGUFFiles:
    model: Path  # the language model
    mmproj: Path  # the vision tower and merger


def export_gguf(model_dir: str | Path, out_dir: str | Path, weights: str = "f32") -> GGUFFiles:
    """Writes OUT/model-WEIGHTS.gguf and OUT/mmproj-VISION.gguf (f32 vision for f32
    weights, f16 otherwise) unless they are already there."""
    import gguf

    if weights not in WEIGHT_TYPES:
        raise ConfigError(f"GGUF weights must be one of {', '.join(WEIGHT_TYPES)}, got {weights!r}")
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = _read_json(model_dir / "config.json")
    if config.get("model_type") not in _FAMILIES:
        raise ConfigError(f"GGUF export covers Qwen2-VL and Qwen2.5-VL checkpoints; "
                          f"{model_dir} is {config.get('model_type')!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    vision_weights = "f32" if weights == "f32" else "f16"
    files = GGUFFiles(out_dir / f"model-{weights}.gguf", out_dir / f"mmproj-{vision_weights}.gguf")
    if not files.model.exists():
        _write_language_model(gguf, model_dir, config, weights, files.model)
    if not files.mmproj.exists():
        _write_mmproj(gguf, model_dir, config, vision_weights, files.mmproj)
    return files


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc


def _checkpoint_tensors(model_dir: Path, visual: bool) -> Iterator[tuple[str, np.ndarray]]:
    """(name, fp32 array) for the vision tower's tensors (visual) or the language model's,
    with transformers' layout prefixes folded to the original checkpoint names
    (`model.layers.*`, `visual.*`, `lm_head.*`)."""
    from foveal.loader.weights import iterate_checkpoint

    for name, tensor in iterate_checkpoint(str(model_dir)):
        name = name.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
        if name.startswith("visual.") == visual:
            yield name, tensor.float().numpy()


def _tensor_type(gguf, array: np.ndarray, weights: str):
    """2-D weights in the requested type (q8_0 where rows split into 32-blocks, else f16);
    everything else f32."""
    if array.ndim < 2 or weights == "f32":
        return gguf.GGMLQuantizationType.F32
    if weights == "q8_0" and array.shape[-1] % 32 == 0:
        return gguf.GGMLQuantizationType.Q8_0
    return gguf.GGMLQuantizationType.F16


def _add_tensor(gguf, writer, name: str, array: np.ndarray, qtype) -> None:
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, array)
    elif qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def _file_type(gguf, weights: str):
    return {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
            "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[weights]


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_language_model(gguf, model_dir: Path, config: dict, weights: str, path: Path) -> None:
    text = {**config, **config.get("text_config", {})}
    rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    layers = int(text["num_hidden_layers"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2VL, layers)
    writer = gguf.GGUFWriter(str(path) + ".partial", "qwen2vl")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(model_dir.name)
    writer.add_block_count(layers)
    writer.add_context_length(int(text.get("max_position_embeddings", 32768)))
    writer.add_embedding_length(int(text["hidden_size"]))
    writer.add_feed_forward_length(int(text["intermediate_size"]))
    writer.add_head_count(int(text["num_attention_heads"]))
    writer.add_head_count_kv(int(text.get("num_key_value_heads", text["num_attention_heads"])))
    writer.add_rope_freq_base(float(rope.get("rope_theta", text.get("rope_theta", 10000.0))))
    sections = list(rope.get("mrope_section", []))
    writer.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])
    writer.add_layer_norm_rms_eps(float(text.get("rms_norm_eps", 1e-6)))
    writer.add_file_type(_file_type(gguf, weights))
    _add_vocab(gguf, writer, model_dir, int(text["vocab_size"]))
    for name, array in _checkpoint_tensors(model_dir, visual=False):
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise CheckpointError(f"no GGUF name for the language-model tensor {name}")
        _add_tensor(gguf, writer, gguf_name, array, _tensor_type(gguf, array, weights))
    _finish(writer)
    Path(str(path) + ".partial").rename(path)


def _add_vocab(gguf, writer, model_dir: Path, vocab_size: int) -> None:
    """The byte-level BPE vocabulary (Qwen2's pre-tokenizer), its merges and special ids."""
    tokenizer = _read_json(model_dir / "tokenizer.json")
    model = tokenizer.get("model", {})
    if model.get("type") != "BPE":
        raise CheckpointError(f"GGUF export needs a BPE tokenizer, {model_dir} has "
                              f"{model.get('type')!r}")
    by_id = {int(i): token for token, i in model.get("vocab", {}).items()}
    kinds = {}
    for added in tokenizer.get("added_tokens", []):
        by_id[int(added["id"])] = added["content"]
        kinds[int(added["id"])] = (gguf.TokenType.CONTROL if added.get("special")
                                   else gguf.TokenType.USER_DEFINED)
    size = max(vocab_size, max(by_id) + 1)
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    types = [kinds.get(i, gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED)
             for i in range(size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=True).add_to_gguf(writer, quiet=True)


def _write_mmproj(gguf, model_dir: Path, config: dict, weights: str, path: Path) -> None:
    vision = config["vision_config"]
    text = {**config, **config.get("text_config", {})}
    qwen25 = config["model_type"] == "qwen2_5_vl"
    depth = int(vision["depth"])
    if int(vision.get("temporal_patch_size", 2)) != 2:
        raise CheckpointError("llama.cpp's Qwen2-VL vision reads a temporal patch of 2")
    width = int(vision["hidden_size"] if qwen25 else vision["embed_dim"])
    ffn = int(vision["intermediate_size"] if qwen25
              else vision["embed_dim"] * vision.get("mlp_ratio", 4))
    processor = _read_json(model_dir / "preprocessor_config.json")
    # the merger MLP is `mm.{0,2}`, numbered like blocks
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(depth, 3))
    writer = gguf.GGUFWriter(str(path) + ".partial", "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(model_dir.name)
    writer.add_file_type(_file_type(gguf, weights))
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(int(text["hidden_size"]))
    writer.add_vision_image_size(int(vision.get("image_size", 560)))
    writer.add_vision_patch_size(int(vision["patch_size"]))
    writer.add_vision_embedding_length(width)
    writer.add_vision_feed_forward_length(ffn)
    writer.add_vision_block_count(depth)
    writer.add_vision_head_count(int(vision["num_heads"]))
    writer.add_vision_image_mean(list(processor["image_mean"]))
    writer.add_vision_image_std(list(processor["image_std"]))
    writer.add_vision_attention_layernorm_eps(float(text.get("rms_norm_eps", 1e-6)))
    if qwen25:
        writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
        writer.add_vision_use_silu(True)
        full = list(vision.get("fullatt_block_indexes", []))
        period = full[0] + 1 if full else depth
        if any(b - a != period for a, b in zip(full, full[1:])):
            raise CheckpointError(f"full-attention blocks {full} are not evenly spaced, "
                                  "which llama.cpp's window-attention pattern needs")
        writer.add_vision_n_wa_pattern(period)
        if int(vision.get("window_size", 112)) != 112:
            raise CheckpointError(f"llama.cpp's Qwen2.5-VL vision attends in 112-pixel windows; "
                                  f"this checkpoint's window_size is {vision['window_size']}")
    else:
        writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN2VL)
    for name, array in _checkpoint_tensors(model_dir, visual=True):
        for gguf_name, part in _vision_tensors(names, name, array):
            qtype = _tensor_type(gguf, part, weights)
            if ".position_embd." in gguf_name:
                qtype = gguf.GGMLQuantizationType.F32
            _add_tensor(gguf, writer, gguf_name, part, qtype)
    _finish(writer)
    Path(str(path) + ".partial").rename(path)


def _vision_tensors(names, name: str, array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """One checkpoint tensor as the mmproj tensors llama.cpp reads."""
    if name == "visual.patch_embed.proj.weight":  # (out, 3, 2, p, p): one kernel per frame
        yield "v.patch_embd.weight", array[:, :, 0]
        yield "v.patch_embd.weight.1", array[:, :, 1]
        return
    gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
    if gguf_name is None:
        raise CheckpointError(f"no GGUF name for the vision tensor {name}")
    if ".attn_qkv." in gguf_name:
        for part, piece in zip("qkv", np.split(array, 3, axis=0)):
            yield gguf_name.replace(".attn_qkv.", f".attn_{part}."), piece
        return
    yield gguf_name, array
