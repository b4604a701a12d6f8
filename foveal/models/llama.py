"""The Llama / Mistral text decoder (LLaVA's language models).

Architecturally it is the Qwen2 decoder (foveal/models/qwen2.py: GQA, 1-D
RoPE through the M-RoPE layer with one section, SwiGLU MLP, RMSNorm) without
q/k/v bias (`TextConfig.attention_bias=False`), tied or untied head. So this
module only names it. Its HF config is read (torch-free, with transformers'
defaults) by `foveal.models.llava_config.decoder_text_config`, which also
reads Qwen2 decoders (LLaVA-OneVision: attention_bias=True).

RoPE runs plain or with linear / llama3 scaling (Llama 3.1, as in
Idefics3-8B); other scalings (dynamic, yarn, longrope) and sliding-window
attention are a ConfigError, not a silent approximation.
"""
from __future__ import annotations

from foveal.models.qwen2 import Qwen2Model

LlamaModel = Qwen2Model
