"""Write a Gemma 3 checkpoint with gemma-3-4b's KV shapes and a narrow body, for
the KV layout benchmark (`foveal bench kv-cache --kv-layouts plain,hybrid`).

The decoder keeps what sizes the KV cache and attention: 34 layers, five
sliding-window layers (window 1024) per full-attention one, 8 query and 4 KV
heads of 256 dims, 256 tokens per 896 px image. The hidden size (256), MLP,
vocabulary and vision tower are narrow, so a 2-core CPU runs multi-thousand-token
prompts in seconds; the weights are random.

    python scripts/build_gemma3_kv_bench_model.py OUT
"""
from __future__ import annotations

import sys

from foveal.loader import presets
from foveal.loader.tiny_model import build_checkpoint

NAME = "gemma-3-4b-kv-shapes"


def main(out: str) -> None:
    config = presets.get_preset("gemma-3-4b")
    config["text_config"].update(hidden_size=256, intermediate_size=512, vocab_size=4096)
    config["vision_config"].update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2)
    presets.PRESETS[NAME] = config
    print(build_checkpoint(out, NAME, dtype="bfloat16"))


if __name__ == "__main__":
    main(sys.argv[1])
