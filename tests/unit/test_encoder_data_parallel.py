"""The data-parallel vision encoder: items split evenly and the same way on
every rank; in data mode the tower is built whole while the decoder shards."""
from __future__ import annotations

import dataclasses

import pytest

from foveal.distributed import parallel_state
from foveal.distributed.encoder_data_parallel import balanced_shares
from foveal.loader.hf_config import model_config_from_dict
from foveal.loader.presets import get_preset


def test_shares_put_the_largest_items_on_the_least_loaded_rank():
    sizes = [64, 16, 16, 100, 4, 4]
    shares = balanced_shares(sizes, 2)
    assert shares == [[3, 5], [0, 1, 2, 4]]  # 100 + 4 against 64 + 16 + 16 + 4
    assert sorted(i for share in shares for i in share) == list(range(len(sizes)))
    assert balanced_shares(sizes, 2) == shares  # deterministic
    assert balanced_shares([5], 3) == [[0], [], []]  # fewer items than ranks


@pytest.mark.parametrize("mode, vision_width", [("weights", 64), ("data", 128)])
def test_data_mode_builds_the_vision_tower_whole_on_each_rank(monkeypatch, mode, vision_width):
    from foveal.models.qwen2_vl import Qwen2VLForConditionalGeneration

    monkeypatch.setattr(parallel_state, "_TP_GROUP",
                        parallel_state.ProcessGroup(rank=1, world_size=2))
    config = dataclasses.replace(model_config_from_dict(get_preset("tiny-qwen2-vl")),
                                 mm_encoder_tp_mode=mode)
    model = Qwen2VLForConditionalGeneration(config)
    fc1 = model.visual.blocks[0].mlp.fc1
    assert fc1.weight.shape[0] == vision_width  # 128 wide: whole, or half per rank
    assert fc1.tp_size == (1 if mode == "data" else 2)
    gate_up = model.language_model.layers[0].mlp.gate_up_proj
    assert gate_up.weight.shape[0] == 2 * 128 // 2  # gate + up, half each: sharded in both
