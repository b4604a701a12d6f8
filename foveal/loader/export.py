"""Write a Foveal model as an HF checkpoint (transformers-5 names).

Fused modules are split back into their checkpoint parts (qkv_proj ->
q/k/v_proj, gate_up_proj -> gate/up_proj) and reshaped parameters
(`hf_shape`, e.g. the patch embedding's Conv3d) get their HF shape back.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from torch import nn

from foveal.distributed import get_tp_size
from foveal.errors import ConfigError


def _export_name(model: nn.Module, name: str) -> str:
    for source, target in model.export_prefixes:
        if name.startswith(source):
            return target + name[len(source):]
    raise ConfigError(f"parameter {name} has no export prefix; add one to "
                      f"{type(model).__name__}.export_prefixes")


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """HF-named full tensors of `model` (tensor-parallel size 1 only)."""
    if get_tp_size() != 1:
        raise ConfigError("export needs the whole model in one process; run it with tensor_parallel_size=1")
    unpacked: dict[str, list[tuple[str, object]]] = {}
    for hf_module, (fused, shard_id) in model.packed_modules.items():
        unpacked.setdefault(fused, []).append((hf_module, shard_id))
    tensors = {}
    for name, param in model.named_parameters():
        *module_path, module_name, leaf = name.split(".")
        tensor = param.detach().reshape(getattr(param, "hf_shape", param.shape))
        if module_name not in unpacked:
            tensors[_export_name(model, name)] = tensor.contiguous()
            continue
        module = model.get_submodule(".".join([*module_path, module_name]))
        for hf_module, shard_id in unpacked[module_name]:
            offset, size = module.local_shard(shard_id)
            hf_name = ".".join([*module_path, hf_module, leaf])
            tensors[_export_name(model, hf_name)] = tensor.narrow(0, offset, size).contiguous()
    return tensors


def save_hf_checkpoint(model: nn.Module, hf_config: dict, out_dir: str,
                       max_shard_bytes: int = 4 << 30) -> None:
    """Write out_dir/config.json and the weights: model.safetensors, or, past
    max_shard_bytes, model-0000k-of-0000n.safetensors shards with
    model.safetensors.index.json (transformers' layout), one shard in memory at a
    time (a 7B model's serialized copy never sits beside the whole model)."""
    os.makedirs(out_dir, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in hf_state_dict(model).items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                for shard in shards for t in shard.values())},
                 "weight_map": {tensor: file for file, shard in zip(names, shards) for tensor in shard}}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    for file, shard in zip(names, shards):
        save_file({name: t.cpu() for name, t in shard.items()}, os.path.join(out_dir, file),
                  metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
