"""Offline checkpoint builder: an HF-format folder from Foveal's own model
classes with random weights, a tokenizer trained in-process with the
architecture's special tokens and real chat template, and processor and
generation configs. Behind `foveal demo`, the tests and the benchmarks."""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

ARCH_PRESETS = {"qwen2_vl": "tiny-qwen2-vl", "qwen2_5_vl": "tiny-qwen2.5-vl",
                "qwen3_vl": "tiny-qwen3-vl", "qwen3_vl_moe": "tiny-qwen3-vl-moe",
                "gemma3": "tiny-gemma3", "llava": "tiny-llava",
                "llava_next": "tiny-llava-next", "llava_onevision": "tiny-llava-onevision",
                "idefics3": "tiny-idefics3", "smolvlm": "tiny-smolvlm"}
# Tiny checkpoints cap image resolution so tests and the demo stay fast.
_TINY_MAX_PIXELS = 448 * 448


def _preprocessor_config(preset: str) -> dict:
    from foveal.multimodal.processors.qwen2_vl import Qwen2VLImageProcessor

    overrides = {"max_pixels": _TINY_MAX_PIXELS} if preset.startswith("tiny") else {}
    return Qwen2VLImageProcessor.from_config({}, overrides).to_config_dict()


def generation_config(special: dict[str, int]) -> dict:
    eos = [special["<|im_end|>"], special["<|endoftext|>"]]
    return {"eos_token_id": eos, "pad_token_id": special["<|endoftext|>"],
            "bos_token_id": special["<|endoftext|>"], "do_sample": False}


def build_checkpoint(out_dir: str | Path, preset: str = "tiny-qwen2-vl", seed: int = 0,
                     weights: bool = True, dtype: str = "float32") -> Path:
    """Write a complete checkpoint folder for `preset` (atomically). weights=False
    writes no safetensors: the folder serves load_format="dummy" (large presets).
    dtype: the stored weights' dtype (config.json says it), e.g. "bfloat16" for a
    7B preset, whose float32 weights would not fit in memory."""
    from foveal.loader.export import save_hf_checkpoint
    from foveal.loader.presets import get_preset
    from foveal.loader.tiny_tokenizer import write_tiny_tokenizer
    from foveal.loader.weights import build_dummy_model

    out_dir = Path(out_dir)
    hf_config = get_preset(preset)
    if dtype != "float32":
        hf_config = {**hf_config, "dtype": dtype}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        if weights:
            save_hf_checkpoint(build_dummy_model(hf_config, seed=seed, dtype=dtype), hf_config, staging)
        else:
            write_json(staging / "config.json", hf_config)
        special = write_tiny_tokenizer(staging, vocab_size=min(512, _vocab_size(hf_config)))
        if hf_config.get("model_type") in ("qwen3_vl", "qwen3_vl_moe"):
            _write_qwen3_vl_files(staging, tiny=preset.startswith("tiny"))
        elif hf_config.get("model_type") == "gemma3":
            from foveal.multimodal.processors.gemma3_family import write_checkpoint_files

            write_checkpoint_files(staging, hf_config)
        elif hf_config.get("model_type") in ("llava", "llava_next", "llava_onevision"):
            from foveal.multimodal.processors.llava_family import write_checkpoint_files as write_llava

            write_llava(staging, hf_config)
        elif hf_config.get("model_type") in ("idefics3", "smolvlm"):
            from foveal.multimodal.processors.idefics3_family import write_checkpoint_files as write_idefics3

            write_idefics3(staging, hf_config)
        else:
            write_json(staging / "preprocessor_config.json", _preprocessor_config(preset))
        write_json(staging / "generation_config.json", generation_config(special))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _write_qwen3_vl_files(folder: Path, tiny: bool) -> None:
    """Qwen3-VL's image and video processor configs and its chat template."""
    from foveal.multimodal.processors.qwen3_vl_family import QWEN3_VL_CHAT_TEMPLATE, tiny_processor_configs

    for name, body in tiny_processor_configs(tiny).items():
        write_json(folder / name, body)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    write_json(folder / "tokenizer_config.json", {**config, "chat_template": QWEN3_VL_CHAT_TEMPLATE})
    (folder / "chat_template.jinja").write_text(QWEN3_VL_CHAT_TEMPLATE, encoding="utf-8")


def ensure_tiny_checkpoint(out_dir: str | Path, preset: str = "tiny-qwen2-vl") -> Path:
    out_dir = Path(out_dir)
    if not (out_dir / "config.json").exists():
        build_checkpoint(out_dir, preset)
    return out_dir


def _vocab_size(hf_config: dict) -> int:
    return hf_config.get("text_config", hf_config)["vocab_size"]


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _run(args: argparse.Namespace) -> int:
    preset = args.preset or ARCH_PRESETS[args.arch]
    path = build_checkpoint(args.out, preset, seed=args.seed, dtype=args.dtype)
    print(f"wrote {preset} checkpoint to {path}")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tiny-model", help="write a random-weight checkpoint (HF format) offline",
        description="Build an HF-format checkpoint folder with random weights, a tokenizer "
                    "trained in-process and the real chat template. Nothing is downloaded.")
    parser.add_argument("out", help="output folder")
    parser.add_argument("--arch", choices=sorted(ARCH_PRESETS), default="qwen2_vl")
    parser.add_argument("--preset", help="any preset instead of --arch's tiny one "
                                         "(tiny-qwen2-vl, tiny-qwen2.5-vl, small, ...)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="stored weight dtype (bfloat16 for presets whose float32 weights "
                             "do not fit in memory)")
    parser.set_defaults(func=_run)
