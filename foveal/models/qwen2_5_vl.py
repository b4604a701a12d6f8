"""Qwen2.5-VL: Qwen2-VL with an RMSNorm / SwiGLU vision tower using window
attention (the variant is read from VisionConfig.variant) and time-aligned
video positions (VisionConfig.tokens_per_second). Same decoder and weight
names, so the architecture is Qwen2-VL's."""
from __future__ import annotations

from foveal.models.qwen2_vl import Qwen2VLForConditionalGeneration


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    pass
