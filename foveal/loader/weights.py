"""Build a model and fill its weights: safetensors checkpoints or dummy.

One loader serves every architecture: the model class declares how
checkpoint names map onto its modules (`weight_prefixes`) and which
checkpoint modules are fused into one (`packed_modules`); each parameter's
`weight_loader` copies its tensor-parallel slice.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import zlib
from typing import TYPE_CHECKING, Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from foveal.config import EngineConfig
from foveal.errors import CheckpointError, ConfigError
from foveal.layers.linear import default_weight_loader
from foveal.loader.kv_scales import KVScaleCollector, is_kv_scale
from foveal.loader.quantized import dequantized_checkpoint
from foveal.logger import init_logger
from foveal.models.registry import get_model_class

if TYPE_CHECKING:
    from foveal.loader.eagle_config import EagleConfig

_MAX_NAMES_SHOWN = 8
logger = init_logger(__name__)


def checkpoint_files(path: str | None) -> list[str]:
    """The safetensors files of a checkpoint folder (shards from the index if any)."""
    if not path or not os.path.isdir(path):
        raise CheckpointError(f"checkpoint folder {path!r} not found; pass the folder holding "
                              "config.json and *.safetensors, or load_format='dummy'")
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    single = os.path.join(path, "model.safetensors")
    files = [single] if os.path.isfile(single) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"no *.safetensors in {path}; convert the checkpoint to safetensors")
    return files


def iterate_checkpoint(path: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _map_name(model: nn.Module, hf_name: str) -> tuple[str | None, object]:
    """Checkpoint name -> (parameter name, shard id), or (None, None) if unmapped."""
    for source, target in model.weight_prefixes:
        if hf_name.startswith(source):
            parts = (target + hf_name[len(source):]).split(".")
            break
    else:
        return None, None
    shard_id = None
    if len(parts) >= 2 and parts[-2] in model.packed_modules:
        parts[-2], shard_id = model.packed_modules[parts[-2]]
    return ".".join(parts), shard_id


def _names(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" and {len(names) - _MAX_NAMES_SHOWN} more" if len(names) > _MAX_NAMES_SHOWN else ""
    return ", ".join(names[:_MAX_NAMES_SHOWN]) + more


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       kv_scales: KVScaleCollector | None = None) -> set[str]:
    """Copy HF-named tensors into `model`; returns the parameter names loaded.

    KV-cache scales (k_scale / v_scale / kv_scale) go to `kv_scales`.
    Raises CheckpointError naming the checkpoint tensors that match no parameter."""
    params = dict(model.named_parameters())
    # a decoder's config has .text; a draft head's (EagleConfig) ties nothing
    tied = getattr(getattr(model.config, "text", None), "tie_word_embeddings", False)
    kv_scales = kv_scales or KVScaleCollector(model)
    loaded, unexpected = set(), []
    for hf_name, tensor in weights:
        name, shard_id = _map_name(model, hf_name)
        if name and is_kv_scale(name):
            module_path, suffix = name.rsplit(".", 1)
            kv_scales.add(module_path, suffix, tensor)
            continue
        if tied and name == "lm_head.weight":
            continue  # some tied checkpoints store the head too; it is the embedding
        param = params.get(name) if name else None
        if param is None:
            unexpected.append(hf_name)
            continue
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        weight_loader(param, tensor.to(param.dtype), shard_id)
        loaded.add(name)
    if unexpected:
        raise CheckpointError(f"checkpoint holds weights this {type(model).__name__} does not have: "
                              f"{_names(unexpected)}; check that config.json matches the weights")
    return loaded


def _dummy_std(name: str, param: nn.Parameter) -> float | None:
    """None: fill with ones (norm scales). Matmul weights get std 1/sqrt(fan_in)
    (at most 0.2) and embeddings 0.2, so logits have clear argmax margins."""
    if param.dim() == 1:
        is_norm = "norm" in name or "ln_q" in name
        return None if is_norm and name.endswith("weight") else 0.02
    if "embed_tokens" in name or "lm_head" in name:
        return 0.2
    return min(0.2, param.shape[1] ** -0.5)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Deterministic random weights: each tensor seeded by (seed, its name), drawn
    on the parameter's device (a 7B model on a GPU fills in seconds; CUDA's
    generator draws other values than the CPU's)."""
    for name, param in model.named_parameters():
        std = _dummy_std(name, param)
        if std is None:
            param.data.fill_(1.0)
            continue
        generator = torch.Generator(param.device).manual_seed(
            seed * 1_000_003 + zlib.crc32(name.encode()))
        values = torch.randn(param.shape, generator=generator, device=param.device) * std
        param.data.copy_(values)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(engine_config: EngineConfig) -> nn.Module:
    """The model class for the architecture, with uninitialized weights."""
    model_cls = get_model_class(engine_config.model.architecture)
    dtype = getattr(torch, engine_config.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype {engine_config.dtype!r} is not a torch dtype; use float32, "
                          "bfloat16 or float16")
    with _default_dtype(dtype), torch.device(engine_config.device):
        return model_cls(engine_config.model)


def _float_checkpoint(engine_config: EngineConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors; a pre-quantized one's layers dequantized to the model dtype."""
    weights = iterate_checkpoint(engine_config.model.path)
    quantization = engine_config.model.checkpoint_quantization
    if quantization is None:
        return weights
    logger.info("dequantizing a pre-quantized checkpoint (%s) to %s weights",
                quantization.describe(), engine_config.dtype)
    return dequantized_checkpoint(weights, quantization, getattr(torch, engine_config.dtype))


def load_model(engine_config: EngineConfig) -> nn.Module:
    """Build the model on engine_config.device / dtype and load its weights."""
    model = build_model(engine_config)
    if engine_config.load_format == "dummy":
        init_dummy_weights(model, engine_config.seed)
    elif engine_config.load_format in ("auto", "safetensors"):
        kv_scales = KVScaleCollector(model)
        loaded = load_named_weights(model, _float_checkpoint(engine_config), kv_scales)
        kv_scales.apply(engine_config.cache.kv_cache_dtype,
                        engine_config.model.text.num_key_value_heads)
        missing = set(dict(model.named_parameters())) - loaded
        if missing:
            raise CheckpointError(f"checkpoint {engine_config.model.path} lacks weights: "
                                  f"{_names(missing)}; check that config.json matches the weights")
    else:
        raise ConfigError(f"load_format {engine_config.load_format!r} is unknown; use 'auto' or 'dummy'")
    return model.eval()


def build_dummy_model(hf_config: dict, seed: int = 0, device: str = "cpu",
                      dtype: str = "float32") -> nn.Module:
    """A model of HF config dict `hf_config` with deterministic dummy weights."""
    from foveal.config import CacheConfig, MultimodalConfig, SchedulerConfig
    from foveal.loader.hf_config import model_config_from_dict

    engine_config = EngineConfig(model_config_from_dict(hf_config), CacheConfig(), SchedulerConfig(),
                                 MultimodalConfig(), dtype=dtype, device=device,
                                 load_format="dummy", seed=seed)
    return load_model(engine_config)


def load_draft_head(config: "EagleConfig", target: nn.Module, device: str, dtype: str) -> nn.Module:
    """An EAGLE head (config: loader.eagle_config.EagleConfig) with its checkpoint's
    weights; the embeddings and LM head it lacks are the target's."""
    from foveal.models.eagle import EagleHead

    names = set()
    for file in checkpoint_files(config.path):
        with safe_open(file, framework="pt", device="cpu") as f:
            names.update(name.removeprefix("model.") for name in f.keys())
    own_embeddings = "embed_tokens.weight" in names
    own_lm_head = "lm_head.weight" in names
    target_hidden = target.config.text.hidden_size
    if not own_embeddings and config.hidden_size != target_hidden:
        raise CheckpointError(f"draft head {config.path} has no embed_tokens and its hidden "
                              f"size {config.hidden_size} differs from the target's "
                              f"{target_hidden}, so it cannot share the target's embeddings")
    if not own_lm_head and config.draft_vocab_size != config.vocab_size:
        raise CheckpointError(f"draft head {config.path} has a draft vocabulary of "
                              f"{config.draft_vocab_size} but no lm_head")
    with _default_dtype(getattr(torch, dtype)), torch.device(device):
        head = EagleHead(config, own_embeddings, own_lm_head, fc_bias="fc.bias" in names)

    def parameters() -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors but d2t (a buffer) and those the head does not keep."""
        for hf_name, tensor in iterate_checkpoint(config.path):
            base = hf_name.removeprefix("model.")
            if base == "d2t":
                head.d2t.copy_(tensor.long())
            elif base not in head.ignored_weights and (
                    config.is_eagle3 or not base.endswith("input_layernorm.weight")):
                yield hf_name, tensor  # (EAGLE-1 runs its layer without an input norm)

    loaded = load_named_weights(head, parameters())
    missing = set(dict(head.named_parameters())) - loaded
    if missing:
        raise CheckpointError(f"draft head {config.path} lacks weights: {_names(missing)}")
    target_ids = torch.arange(config.draft_vocab_size, device=head.d2t.device) + head.d2t
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= config.vocab_size:
        raise CheckpointError(f"draft head {config.path}: d2t maps draft ids outside the "
                              f"target vocabulary [0, {config.vocab_size})")
    return head.eval()
