"""An EAGLE draft head's config.json -> EagleConfig, checked against its target.

Reads the layouts vLLM and SGLang load: EAGLE-1 heads (a Llama-style config:
`fc` over [token embedding, target feature], one decoder layer without an
input norm, the target's LM head) and EAGLE-3 heads (`LlamaForCausalLMEagle3`:
`fc` over three of the target's layers, one `midlayer` over [normed
embedding, normed feature], a final norm, an LM head over a draft vocabulary
mapped to the target's by `d2t`). Torch-free: the engine options check a head
before any weights load.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from foveal.config import TextConfig
from foveal.errors import ConfigError

EAGLE_METHODS = ("eagle", "eagle3")


@dataclass(frozen=True)
class EagleConfig:
    method: str  # "eagle" | "eagle3"
    path: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]  # () -> 1-D RoPE on the target's first position axis
    hidden_act: str
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    # EAGLE-3: the target layers whose inputs are concatenated into `fc`.
    aux_layer_ids: tuple[int, ...] = ()
    attention_bias: bool = False
    norm_before_residual: bool = False

    @property
    def is_eagle3(self) -> bool:
        return self.method == "eagle3"


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's and SGLang's choice, (2, L/2, L-3), kept inside a short target."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


def load_eagle_config(method: str, path: str | None, target: TextConfig) -> EagleConfig:
    """The head at `path` for `method`; ConfigError when it does not fit the target."""
    if method not in EAGLE_METHODS:
        raise ConfigError(f"{method!r} is not an EAGLE method; use one of {EAGLE_METHODS}")
    if not path:
        raise ConfigError(f"speculative method {method!r} needs a draft head: "
                          "speculative_config={'method': ..., 'model': DIR}")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"draft head {path!r} has no config.json")
    with open(config_path, encoding="utf-8") as f:
        raw = json.load(f)
    config = _from_dict(method, path, raw, target)
    _check_fits(config, target)
    return config


def _from_dict(method: str, path: str, raw: dict, target: TextConfig) -> EagleConfig:
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        eagle = raw.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids") or raw.get(
            "eagle_aux_hidden_state_layer_ids")
        return EagleConfig(
            method=method, path=path, hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            mrope_section=tuple(int(s) for s in rope.get("mrope_section") or ()),
            hidden_act=raw.get("hidden_act", "silu"),
            vocab_size=int(raw.get("vocab_size", target.vocab_size)),
            draft_vocab_size=int(raw["draft_vocab_size"] if raw.get("draft_vocab_size") is not None
                                 else raw.get("vocab_size", target.vocab_size)),
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            aux_layer_ids=(tuple(int(i) for i in aux) if aux
                           else default_aux_layer_ids(target.num_hidden_layers))
            if method == "eagle3" else (),
            attention_bias=bool(raw.get("attention_bias", raw.get("qkv_bias", False))),
            norm_before_residual=bool(raw.get("norm_before_residual", False)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"draft head config {path}/config.json is not an EAGLE config: "
                          f"{type(exc).__name__}: {exc}") from exc


def _check_fits(config: EagleConfig, target: TextConfig) -> None:
    where = f"draft head {config.path}"
    if config.vocab_size != target.vocab_size:
        raise ConfigError(f"{where} has vocab_size {config.vocab_size} but the target has "
                          f"{target.vocab_size}; it was trained for another model")
    if config.target_hidden_size != target.hidden_size:
        raise ConfigError(f"{where} reads features of size {config.target_hidden_size} but the "
                          f"target's hidden size is {target.hidden_size}")
    if not config.is_eagle3 and config.hidden_size != target.hidden_size:
        raise ConfigError(f"{where}: an EAGLE-1 head's hidden size ({config.hidden_size}) must "
                          f"equal the target's ({target.hidden_size})")
    if not 0 < config.draft_vocab_size <= config.vocab_size:
        raise ConfigError(f"{where}: draft_vocab_size {config.draft_vocab_size} must be in "
                          f"[1, {config.vocab_size}]")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ConfigError(f"{where}: {config.num_attention_heads} attention heads do not "
                          f"group over {config.num_key_value_heads} KV heads")
    if config.mrope_section and 2 * sum(config.mrope_section) != config.head_dim:
        raise ConfigError(f"{where}: mrope_section {list(config.mrope_section)} does not "
                          f"cover head_dim {config.head_dim}")
    layers = target.num_hidden_layers
    bad = [i for i in config.aux_layer_ids if not 0 <= i < layers]
    if config.is_eagle3 and (len(config.aux_layer_ids) != 3 or bad):
        raise ConfigError(f"{where}: eagle_aux_hidden_state_layer_ids "
                          f"{list(config.aux_layer_ids)} must be 3 layer ids in [0, {layers})")


def eagle3_config_dict(config: EagleConfig) -> dict:
    """config.json of an EAGLE-3 head, as SGLang and vLLM read it."""
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.mrope_section:
        rope["mrope_section"] = list(config.mrope_section)
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "num_hidden_layers": 1, "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": config.hidden_act, "rope_theta": config.rope_theta,
        "rope_scaling": rope, "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "attention_bias": config.attention_bias, "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
                         "use_aux_hidden_state": True},
    }
