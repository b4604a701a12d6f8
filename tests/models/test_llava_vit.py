"""foveal.models.vit equals transformers' CLIPVisionModel and SiglipVisionModel
on tiny random configs: every hidden layer, the post-LN output, weight loading."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel

from foveal.errors import ConfigError
from foveal.loader.weights import load_named_weights
from foveal.models.vit import VIT_PACKED_MODULES, ViTConfig, VisionEncoder

_CASES = {
    "clip": (CLIPVisionConfig, CLIPVisionModel,
             dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  image_size=56, patch_size=14)),
    "siglip": (SiglipVisionConfig, SiglipVisionModel,
               dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                    image_size=42, patch_size=14, vision_use_head=False)),
    # the image side is no multiple of the patch (SigLIP-so400m: 384 = 27 x 14 + 6)
    "siglip_remainder": (SiglipVisionConfig, SiglipVisionModel,
                         dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=2, image_size=48, patch_size=14,
                              vision_use_head=False)),
}


class _Tower(nn.Module):
    # transformers 5 names the modules without the `vision_model.` of older checkpoints
    weight_prefixes = (("vision_model.", "vision_model."), ("", "vision_model."))
    packed_modules = VIT_PACKED_MODULES

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = SimpleNamespace()
        self.vision_model = VisionEncoder(config)


@pytest.fixture(scope="module", params=sorted(_CASES))
def towers(request):
    config_cls, model_cls, kwargs = _CASES[request.param]
    hf_config = config_cls(**kwargs)
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = model_cls(hf_config).float().eval()
    with torch.no_grad():
        for param in hf.parameters():  # non-trivial norms and biases
            param.add_(torch.randn_like(param) * 0.05)
    ours = _Tower(ViTConfig.from_hf(hf_config.to_dict()))
    loaded = load_named_weights(ours, hf.state_dict().items())
    assert loaded == set(dict(ours.named_parameters()))
    return hf, ours.vision_model, hf_config


@torch.no_grad()
def test_every_hidden_layer_matches_transformers(towers):
    hf, ours, config = towers
    pixels = torch.randn(2, 3, config.image_size, config.image_size)
    expected = hf(pixel_values=pixels, output_hidden_states=True)
    for layer in range(-config.num_hidden_layers - 1, config.num_hidden_layers + 1):
        torch.testing.assert_close(ours(pixels, (layer,)), expected.hidden_states[layer],
                                   atol=1e-5, rtol=1e-5)
    normed = ours(pixels, post_layernorm=True)
    if config.model_type == "siglip_vision_model":  # SigLIP's last_hidden_state is post-LN
        torch.testing.assert_close(normed, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
    else:  # CLIP post-norms only its pooled CLS row
        torch.testing.assert_close(normed[:, 0], expected.pooler_output, atol=1e-5, rtol=1e-5)
    both = ours(pixels, (-2, 1))
    torch.testing.assert_close(both, torch.cat([expected.hidden_states[-2], expected.hidden_states[1]], -1))


def test_feature_layer_out_of_range_is_a_config_error(towers):
    _, ours, config = towers
    with pytest.raises(ConfigError, match="outside"):
        ours(torch.zeros(1, 3, config.image_size, config.image_size), (config.num_hidden_layers + 1,))


def test_wrong_image_size_is_a_config_error(towers):
    _, ours, config = towers
    with pytest.raises(ConfigError, match="built for"):
        ours(torch.zeros(1, 3, config.image_size + 14, config.image_size))
